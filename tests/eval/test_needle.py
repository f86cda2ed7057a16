"""Needle grid (posformer.eval.needle): passkey exact match per haystack length x needle depth."""

from __future__ import annotations

import json

import pytest
import torch

from posformer.data.synthetic import N_SPECIAL, collate_decoder
from posformer.errors import ConfigError
from posformer.eval.needle import FIELDS, cell_rows, main, needle_grid, write_needle

KEY_MARK = N_SPECIAL + 10
VOCAB = N_SPECIAL + 16  # digits, <key>, 5 fillers


def test_cells_put_the_key_at_the_depth():
    for depth, where in ((0.0, 0), (0.5, 10), (1.0, 20), (0.26, 5)):
        rows = cell_rows(20, depth, 3, key_len=4, seed=0)
        for r in rows:
            assert len(r["prompt"]) == 20 + 1 + 4 and r["prompt"].index(KEY_MARK) == where
            assert r["prompt"][where + 1 : where + 5] == r["answer"]
    assert cell_rows(20, 0.5, 3, 4, seed=0) == cell_rows(20, 0.5, 3, 4, seed=0) != cell_rows(20, 0.5, 3, 4, 1)


def explicit_exact(model, rows) -> float:
    """Greedy teacher-forced check of every key digit and EOS, one sequence at a time, no padding."""
    right = 0
    for r in rows:
        seq = torch.tensor(r["prompt"] + [3] + r["answer"] + [2])  # prompt SEP key EOS
        with torch.no_grad():
            pred = model(seq[None, :-1]).argmax(-1)[0]  # (T,)
        start = len(r["prompt"])  # the logit at SEP predicts the first digit
        right += bool(torch.equal(pred[start:], seq[start + 1 :]))
    return right / len(rows)


def test_grid_matches_an_explicit_scorer(tiny_model):
    model = tiny_model("alibi", vocab_size=VOCAB)
    cells = needle_grid(model, [4, 12], [0.0, 1.0], n_per_cell=5, key_len=1, seed=3, train_len=(4, 8))
    assert [(c["length"], c["depth"]) for c in cells] == [(4, 0.0), (4, 1.0), (12, 0.0), (12, 1.0)]
    for c in cells:
        rows = cell_rows(c["length"], c["depth"], 5, key_len=1, seed=3)
        assert c["exact_match"] == explicit_exact(model, rows) and c["n_sequences"] == 5
    assert [c["in_distribution"] for c in cells] == [True, True, False, False]
    padded = collate_decoder(cell_rows(12, 0.0, 2, 1, 3))["attention_mask"]
    assert padded.all()  # one length per cell: no padding changes the score


def test_writes_json_csv_markdown_and_the_heat_map(tmp_path, tiny_model):
    model = tiny_model("rope", vocab_size=VOCAB)
    cells = needle_grid(model, [4, 8, 16], [0.0, 0.5, 1.0], n_per_cell=4, key_len=2, train_len=(4, 8))
    paths = write_needle(cells, tmp_path, {"label": "rope tiny"})
    saved = json.loads(paths["json"].read_text())
    assert saved["cells"] == cells and saved["meta"]["label"] == "rope tiny"
    assert paths["csv"].read_text().splitlines()[0] == ",".join(FIELDS)
    assert len(paths["csv"].read_text().splitlines()) == 1 + 9
    md = paths["md"].read_text()
    assert "| length | depth 0 | depth 0.5 | depth 1 |" in md and md.count("\n|") >= 4
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert paths["svg"].read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize(
    "args,match",
    [
        (["--lengths", "0"], r"lengths=\[0\] must be integers >= 1"),
        (["--depths", "1.5"], r"depths=\[1\.5\] must be in \[0, 1\]"),
        (["--n", "0"], r"n_per_cell=0 must be >= 1"),
    ],
)
def test_bad_grid_is_one_line_before_loading(args, match, tmp_path):
    with pytest.raises(ConfigError, match=match) as info:
        main([str(tmp_path / "missing.ckpt"), *args, "--out", str(tmp_path / "o")])
    assert "\n" not in str(info.value) and not (tmp_path / "o").exists()


def test_a_checkpoint_of_another_task_is_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match=r"trained on data task 'reverse'.*needs .* data=passkey"):
        main([str(tiny_checkpoint), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_the_posformer_needle_command_is_one_line_and_status_1(tiny_checkpoint, tmp_path, capsys):
    """The installed entry point (posformer.cli.needle) wraps the grid in the one error boundary."""
    from posformer.cli.needle import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main([str(tiny_checkpoint), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 1 and err.startswith("posformer-needle: error: ") and "\n" not in err
    assert "data=passkey" in err and not (tmp_path / "o").exists()
