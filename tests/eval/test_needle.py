"""Needle grid (posformer.eval.needle): passkey exact match per haystack length x needle depth."""

from __future__ import annotations

import json

import pytest
import torch

from posformer.data.synthetic import N_SPECIAL, collate_decoder
from posformer.errors import ConfigError
from posformer.eval.needle import (
    FIELDS,
    bin_positions,
    binned_rows,
    cell_rows,
    compare_with_harness,
    harness_exact_match,
    main,
    needle_grid,
    print_comparison,
    write_needle,
)

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


# ---------------------------------------------------------------------------- sampled depths vs the harness
class ChunkStartRetriever(torch.nn.Module):
    """A stand-in passkey model that retrieves the key only when it starts a chunk of ``chunk`` positions
    (``<key>`` at a multiple of ``chunk``), and is wrong elsewhere: the failure of a chunked layer whose
    keys straddle a boundary, without training one."""

    def __init__(self, vocab: int, key_len: int, chunk: int = 8):
        super().__init__()
        self.vocab, self.key_len, self.chunk = vocab, key_len, chunk
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a module with a parameter, as Fabric expects

    def forward(self, input_ids, positions=None, attention_mask=None):  # (B, T) -> (B, T, V)
        b, t = input_ids.shape
        logits = torch.zeros(b, t, self.vocab) + self.anchor
        for i in range(b):
            ids = input_ids[i].tolist()
            k, s = ids.index(KEY_MARK), ids.index(3)  # <key>, SEP
            found = k % self.chunk == 0
            for j in range(self.key_len):
                digit = ids[k + 1 + j]
                logits[i, s + j, digit if found else N_SPECIAL + (digit - N_SPECIAL + 1) % 10] = 1.0
            logits[i, s + self.key_len, 2] = 1.0  # EOS
        return logits


def _passkey_data(tmp_path, key_len: int):
    from posformer.data import build_datamodule

    cfg = {
        "name": "synthetic",
        "task": "passkey",
        "key_len": key_len,
        "train_len": [8, 32],
        "eval_lengths": [32, 64],
        "n_train": 16,
        "n_val": 16,
        "n_eval_per_length": 256,
        "batch_size": 64,
        "cache_dir": str(tmp_path / "cache"),
    }
    dm = build_datamodule(cfg, "decoder", 0)
    dm.prepare_data()
    dm.setup("test")
    return dm


def test_sampled_bins_partition_every_key_position():
    for length, bins in ((32, 10), (64, 10), (9, 10), (100, 3)):
        spans = [bin_positions(length, b, bins) for b in range(bins)]
        assert [p for r in spans for p in r] == list(range(length + 1))
        assert max(map(len, spans)) - min(map(len, spans)) <= 1
    rows = binned_rows(64, 3, 10, 40, key_len=2, seed=0)
    assert {r["where"] for r in rows} <= set(bin_positions(64, 3, 10)) and len({r["where"] for r in rows}) > 1
    for r in rows:
        assert r["prompt"].index(KEY_MARK) == r["where"]


def test_fixed_depths_on_chunk_starts_disagree_and_sampled_bins_agree(tmp_path, capsys):
    """Fixed depths 0, 1/4, ... at lengths 32 and 64 put every key on a chunk start and score 1.0; the
    harness (uniform positions, as in training) scores about 1/8. The sampled bins agree with it within
    sampling error; the fixed depths get the one-line disagreement."""
    key_len = 2
    model = ChunkStartRetriever(VOCAB, key_len)
    harness = harness_exact_match(model, _passkey_data(tmp_path, key_len), [32, 64], tmp_path / "harness")
    assert all(0.05 < h["exact_match"] < 0.25 and h["n_sequences"] == 256 for h in harness.values())

    fixed = needle_grid(model, [32, 64], [0.0, 0.25, 0.5, 0.75, 1.0], n_per_cell=8, key_len=key_len)
    assert all(c["exact_match"] == 1.0 for c in fixed)
    rows, lines = compare_with_harness(fixed, harness)
    assert [(r["length"], r["agree"]) for r in rows] == [(32, False), (64, False), ("all", False)]
    assert len(lines) == 3 and all(
        "\n" not in line and "needle grid and harness disagree" in line for line in lines
    )
    assert "over all lengths" in lines[-1]

    sampled = needle_grid(model, [32, 64], bins=8, n_per_cell=32, key_len=key_len, seed=1)
    rows, lines = compare_with_harness(sampled, harness)
    assert lines == [] and all(r["agree"] for r in rows) and rows[-1]["length"] == "all"
    for r in rows:
        assert abs(r["grid_mean"] - r["harness"]) <= 3 * r["se"] and 0.05 < r["grid_mean"] < 0.25
    paths = write_needle(sampled, tmp_path / "out", {"label": "chunked"}, (rows, lines))
    saved = json.loads(paths["json"].read_text())
    assert saved["harness"]["rows"][0]["harness"] == harness[32]["exact_match"]
    assert "## Grid mean vs posformer-eval" in paths["md"].read_text()
    print_comparison(*compare_with_harness(fixed, harness))
    out = capsys.readouterr().out
    assert "grid mean 1.000" in out and out.count("disagree at length") == 2 and "length all:" in out
