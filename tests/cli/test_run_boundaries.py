"""Run boundaries: a checkpoint cannot act outside its run, no run silently replaces
another, validation cannot be bypassed, and filesystem / config oddities are one clear line.

Every case goes through the real mains (``posformer.cli.train.main`` / ``posformer.cli.evaluate.main``,
in-process with ``sys.argv`` patched, as ``tests/lit/test_lifecycle.py`` does) and checks the exit status,
no traceback, one line naming the value and the fix, and that nothing outside was touched.
docs/reliability.md ("A checkpoint is data, ...") maps each class to its test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli_cases import TINY_RUN, call, eval_cli, one_clear_line

TINY = TINY_RUN


# ------------------------------------------------------------------------------------------ helpers
def train(run: Path, cache: Path, args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """``posformer-train`` + the tiny run's overrides + ``hydra.run.dir=run`` + ``args``."""
    from posformer.cli.train import main

    argv = ["posformer-train", *TINY, f"hydra.run.dir={run}", f"paths.root_dir={run.parent}"]
    return call(main, [*argv, f"paths.cache_dir={cache}", "torch_threads=1", *args], monkeypatch, capsys)


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def earlier(tiny_run_dir, tmp_path) -> Path:
    """A copy of the session's finished tiny run (4 steps)."""
    run = tmp_path / "earlier"
    shutil.copytree(tiny_run_dir, run)
    return run


def edit_checkpoint(path: Path, edit) -> None:
    """Rewrite the checkpoint at ``path`` after ``edit(ckpt_dict)`` (what an attacker can do)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    edit(ckpt)
    torch.save(ckpt, path)


def checkpoint_state(ckpt: dict) -> dict:
    """The ``ModelCheckpoint`` state of a checkpoint dict."""
    return next(v for k, v in ckpt["callbacks"].items() if "ModelCheckpoint" in str(k))


# ------------------------------------------------------------------------ 1. checkpoints are data
def test_resume_never_deletes_a_file_its_callback_state_names_outside_the_run(
    earlier, tmp_path, cache, monkeypatch, capsys
):
    """A resumed checkpoint whose ModelCheckpoint state names ``<ckpt dir>/../../victim.txt`` as its best
    and last file: on main Lightning deleted that file when it saved the next checkpoint (exit 0)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours\n")
    ckpt_dir = earlier / "checkpoints"
    crafted = str(ckpt_dir / ".." / ".." / "victim.txt")

    def poison(ckpt: dict) -> None:
        state = checkpoint_state(ckpt)
        state.update(dirpath=str(ckpt_dir), best_model_path=crafted, last_model_path=crafted)
        state["best_k_models"] = {crafted: torch.tensor(0.0)}

    edit_checkpoint(ckpt_dir / "last.ckpt", poison)
    code, text = train(
        earlier, cache, [f"ckpt_path={ckpt_dir / 'last.ckpt'}", "trainer.max_steps=8"], monkeypatch, capsys
    )
    assert code == 0, text[-3000:]
    assert victim.read_text() == "not yours\n"
    assert "victim.txt" in text and "ignored" in text  # one warning names the ignored path
    assert json.loads((earlier / "results.json").read_text())["global_step"] == 8


def test_resume_in_a_moved_run_dir_keeps_one_last_checkpoint(earlier, tmp_path, cache, monkeypatch, capsys):
    """The session's run dir copied elsewhere (a moved run) and resumed there: its last.ckpt is replaced,
    not joined by a ``last-v1.ckpt`` beside the stale one (main: Lightning ignored the saved state)."""
    ckpt = earlier / "checkpoints" / "last.ckpt"
    code, text = train(earlier, cache, [f"ckpt_path={ckpt}", "trainer.max_steps=8"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    names = sorted(p.name for p in (earlier / "checkpoints").iterdir())
    assert "last.ckpt" in names and not [n for n in names if n.startswith("last-v")], names
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 8


PLUGIN = """
from pathlib import Path
Path({marker!r}).write_text("imported")
from posformer.pe.alibi import ALiBi as Base

class Bias(Base):
    pass
"""


def test_eval_imports_a_checkpoint_pe_only_when_the_user_names_it(earlier, tmp_path, monkeypatch, capsys):
    """A checkpoint whose saved ``model.pe`` is ``evil_pe:Bias``: posformer-eval refuses it in one line
    and the module's import-time code never runs (main: it ran before the refusal); named on the
    command line too, or with ``+trust_checkpoint_code=true``, it is imported."""
    marker = tmp_path / "imported.txt"
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "evil_pe.py").write_text(PLUGIN.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    ckpt = earlier / "checkpoints" / "last.ckpt"
    edit_checkpoint(ckpt, lambda c: c["hyper_parameters"]["model"].update(pe="evil_pe:Bias"))
    out = tmp_path / "eval"
    code, text = eval_cli([f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4]"], out, monkeypatch, capsys)
    one_clear_line(code, text, 2, "evil_pe:Bias", "trust_checkpoint_code=true")
    assert not marker.exists()
    assert not (out / "extrapolation.json").exists()
    # trusted explicitly: imported (and then refused or evaluated, but no longer by the trust check)
    args = [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4]", "+trust_checkpoint_code=true"]
    code, text = eval_cli(args, tmp_path / "eval2", monkeypatch, capsys)
    assert marker.exists(), text[-2000:]
    assert "trust_checkpoint_code" not in text


def test_eval_never_writes_into_a_cache_dir_the_checkpoint_names(earlier, tmp_path, monkeypatch, capsys):
    """The checkpoint's saved data config names ``cache_dir=<elsewhere>``: posformer-eval evaluates with
    the default cache (``$POSFORMER_CACHE``) and writes nothing there (main: it wrote 17 files)."""
    elsewhere = tmp_path / "attacker_chosen"
    ckpt = earlier / "checkpoints" / "last.ckpt"
    edit_checkpoint(ckpt, lambda c: c["hyper_parameters"]["data"]["config"].update(cache_dir=str(elsewhere)))
    monkeypatch.setenv("POSFORMER_CACHE", str(tmp_path / "default_cache"))
    out = tmp_path / "eval"
    code, text = eval_cli([f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4]"], out, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert not elsewhere.exists()
    assert (tmp_path / "default_cache").exists()


# ------------------------------------------------------------------------ 2. ownership of output dirs
def test_a_new_run_into_a_finished_run_dir_is_refused_before_any_write(earlier, cache, monkeypatch, capsys):
    """Another seed into a finished run's dir (main: exit 0, its config, .hydra/ and results replaced):
    one line naming the dir, what it holds and the way back in (resume); every file byte-identical."""
    before = snapshot(earlier)
    code, text = train(earlier, cache, ["seed=7"], monkeypatch, capsys)
    line = one_clear_line(code, text, 1, "belongs to", "results.json")
    assert f"ckpt_path={earlier / 'checkpoints' / 'last.ckpt'}" in line
    after = snapshot(earlier)
    assert {k: v for k, v in after.items() if k != "train.log"} == {
        k: v for k, v in before.items() if k != "train.log"
    }


def test_a_second_sweep_into_an_existing_sweep_dir_is_refused(tmp_path, cache, monkeypatch, capsys):
    """``-m hydra.sweep.dir=<a sweep's dir>``: refused before Hydra starts (main: the new job 0 replaced
    the first sweep's job 0)."""
    from posformer.cli.train import main

    sweep = tmp_path / "sweep"
    (sweep / "0" / ".hydra").mkdir(parents=True)
    (sweep / "0" / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (sweep / "0" / "results.json").write_text('{"first": "sweep"}\n')
    (sweep / "multirun.yaml").write_text("first: sweep\n")
    before = snapshot(sweep)
    argv = ["posformer-train", "-m", *TINY, f"hydra.sweep.dir={sweep}", f"paths.cache_dir={cache}", "seed=1"]
    code, text = call(main, argv, monkeypatch, capsys)
    one_clear_line(code, text, 1, f"hydra.sweep.dir={str(sweep)!r} already holds a sweep", "job dirs 0")
    assert snapshot(sweep) == before


# ------------------------------------------------------------- 3. validation that cannot be bypassed
@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("trainer.val_check_interval=nan", ("trainer.val_check_interval=nan",)),
        ("trainer.gradient_clip_val=inf", ("trainer.gradient_clip_val=inf",)),
        ("optim.lr=nan", ("optim.lr=nan",)),
        ("model.pe_options.base=nan", ("model.pe_options.base=nan", "finite")),
        ("+optimizer.lr=0.1", ("optimizer", "did you mean optim.lr")),
        ("+trainr.max_steps=3", ("trainr", "did you mean trainer.max_steps")),
    ],
    ids=["nan_val_check_interval", "inf_clip", "nan_lr", "nan_rope_base", "optimizer_lr", "trainr"],
)
def test_values_no_check_saw_are_refused_before_any_write(
    override, needles, tmp_path, cache, monkeypatch, capsys
):
    """NaN/inf in any trainer, optim or PE value, and a top-level key no code reads (``+optimizer.lr``
    meant ``optim.lr``): on 6b05113 they crashed later (Lightning's exception), trained into NaN, or were
    ignored; the typed schema now refuses some of them, this round the rest (an infinite clip value, a
    NaN PE option) and names the nested key meant. One line, exit 1, no run dir left behind."""
    code, text = train(tmp_path / "run", cache, [override], monkeypatch, capsys)
    one_clear_line(code, text, 1, *needles)
    assert not (tmp_path / "run").exists()  # the run dir Hydra made for it is gone again


def test_a_local_override_file_without_its_package_header_is_refused(tmp_path, cache, monkeypatch, capsys):
    """``configs/local/default.yaml`` without ``# @package _global_``: everything it sets lands under
    ``local.`` where nothing reads it (6b05113: accepted and silently ignored; since the typed schema:
    "local is not a setting"). Now one line naming the file and the header to add."""
    search = tmp_path / "extra_configs"
    (search / "local").mkdir(parents=True)
    (search / "local" / "default.yaml").write_text("trainer:\n  max_steps: 2\n")
    run = tmp_path / "run"
    code, text = train(run, cache, [f"hydra.searchpath=[file://{search}]"], monkeypatch, capsys)
    one_clear_line(code, text, 1, "local/default.yaml has no package header", "'# @package _global_'")
    assert not (run / "config.yaml").exists()


# ------------------------------------------------------------------------ 3b. data fingerprints
TEXT_RUN = [
    *(a for a in TINY if not a.startswith(("data.", "trainer.max_steps", "trainer.val_check"))),
    "data=text",
    "data.block_size=8",
    "data.eval_lengths=[8]",
    "data.batch_size=8",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
]
TEXT = "".join(f"line {i % 17}: to be or not to be, that is the question.\n" for i in range(60))


def test_resume_on_another_task_with_the_same_vocabulary_is_refused(earlier, cache, monkeypatch, capsys):
    """The session's run (task reverse) resumed with ``data.task=copy``: same vocabulary, same model, so
    main resumed it silently on the other task. Now the data fingerprint recorded at training differs:
    one line, exit 1, the run's files byte-identical."""
    before = snapshot(earlier)
    ckpt = earlier / "checkpoints" / "last.ckpt"
    args = ["data.task=copy", f"ckpt_path={ckpt}", "trainer.max_steps=8"]
    code, text = train(earlier, cache, args, monkeypatch, capsys)
    one_clear_line(code, text, 1, "trained on other data", "fingerprint")
    after = snapshot(earlier)
    assert {k: v for k, v in after.items() if k != "train.log"} == {
        k: v for k, v in before.items() if k != "train.log"
    }


def test_eval_of_a_data_file_edited_after_training_is_refused(tmp_path, cache, monkeypatch, capsys):
    """A text LM trained on a file that is then edited (every 'e' -> 'x': same vocabulary size, other
    characters): main evaluated it with shifted token ids and no word. Now posformer-eval refuses in one
    line (an ``eval.data`` override that chooses other data on purpose makes it a warning)."""
    from posformer.cli.train import main

    data = tmp_path / "corpus.txt"
    data.write_text(TEXT, encoding="utf-8")
    run = tmp_path / "run"
    argv = ["posformer-train", *TEXT_RUN, f"data.path={data}", f"hydra.run.dir={run}"]
    code, text = call(main, [*argv, f"paths.cache_dir={cache}"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    fp = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]["data"]["fingerprint"]
    assert isinstance(fp, str) and len(fp) == 16
    args = [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[8]"]
    code, text = eval_cli(args, tmp_path / "e0", monkeypatch, capsys)
    assert code == 0 and "other data" not in text, text[-3000:]  # unchanged data: no word
    data.write_text(TEXT.replace("e", "x"), encoding="utf-8")
    out = tmp_path / "eval"
    code, text = eval_cli([f"eval.checkpoints=[{ckpt}]", "eval.lengths=[8]"], out, monkeypatch, capsys)
    one_clear_line(code, text, 2, "trained on other data", f"fingerprint {fp} at training")
    assert not (out / "extrapolation.json").exists()


# ------------------------------------------------------------------------ 4. one filesystem boundary
@pytest.mark.parametrize(
    ("entry", "kind"),
    [
        ("config.yaml", "dir"),
        ("results.json", "dir"),
        ("train.log", "dir"),
        (".posformer.lock", "dir"),
        ("checkpoints", "file"),
        ("tokenizer", "file"),
        (".hydra", "file"),
        ("config.yaml", "loop"),
    ],
    ids=["config_dir", "results_dir", "log_dir", "lock_dir", "ckpts_file", "tok_file", "hydra_file", "loop"],
)
def test_a_wrong_kind_of_path_in_the_run_dir_is_one_line(entry, kind, tmp_path, cache, monkeypatch, capsys):
    """A run-dir entry that is a directory where posformer (or Hydra) writes a file, a file where it makes
    a directory, or a symlink loop: main ended in a traceback (IsADirectoryError, NotADirectoryError,
    ELOOP). Now one line naming the path and the fix, exit 1; the entry is left as it was."""
    run = tmp_path / "run"
    run.mkdir()
    path = run / entry
    if kind == "dir":
        path.mkdir()
    elif kind == "file":
        path.write_text("in the way\n")
    else:
        path.symlink_to(path)
    code, text = train(run, cache, [], monkeypatch, capsys)
    line = one_clear_line(code, text, 1, str(path))
    assert "move" in line or "link" in line, line
    assert path.is_symlink() if kind == "loop" else (path.is_dir() == (kind == "dir"))


def test_a_symlink_loop_as_the_run_dir_is_one_line(tmp_path, cache, monkeypatch, capsys):
    """``hydra.run.dir=<a symlink to itself>``: main failed in Hydra's mkdir with a traceback."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    code, text = train(loop, cache, [], monkeypatch, capsys)
    one_clear_line(code, text, 1, "hydra.run.dir=", "symlink that leads nowhere")


def test_a_symlink_loop_as_the_data_file_is_one_line(tmp_path, cache, monkeypatch, capsys):
    from posformer.cli.train import main

    loop = tmp_path / "corpus.txt"
    loop.symlink_to(loop)
    argv = ["posformer-train", *TEXT_RUN, f"data.path={loop}", f"hydra.run.dir={tmp_path / 'run'}"]
    code, text = call(main, [*argv, f"paths.cache_dir={cache}"], monkeypatch, capsys)
    one_clear_line(code, text, 1, str(loop))


# ------------------------------------------------------------------------ 5. config oddities
@pytest.mark.parametrize(
    ("source", "needles"),
    [
        ("raise RuntimeError('broken at import')\n", ("bad_pe:Bias", "RuntimeError: broken at import")),
        ("class Bias(:\n", ("bad_pe:Bias", "SyntaxError")),
    ],
    ids=["raises", "syntax_error"],
)
def test_a_plugin_pe_that_fails_at_import_is_one_line(source, needles, tmp_path, cache, monkeypatch, capsys):
    """``model.pe=bad_pe:Bias`` whose module raises or does not parse: main printed the traceback."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "bad_pe.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    args = ["pe=custom", "model.pe=bad_pe:Bias"]
    code, text = train(tmp_path / "run", cache, args, monkeypatch, capsys)
    line = one_clear_line(code, text, 1, *needles)
    assert "bad_pe.py" in line  # where to look


@pytest.mark.parametrize("pe", ["./plugins/my_pe.py:Bias", ".my_pe:Bias", "plugins/my_pe:Bias"])
def test_a_plugin_pe_given_as_a_relative_path_is_one_line(pe, tmp_path, cache, monkeypatch, capsys):
    code, text = train(tmp_path / "run", cache, ["pe=custom", f"model.pe={pe}"], monkeypatch, capsys)
    one_clear_line(code, text, 1, f"model.pe={pe!r}", "PYTHONPATH")


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("seed: [1, 2\n", ("broken.yaml", "line")),
        ("seed: !!python/object/apply:os.system ['echo pwned']\n", ("broken.yaml", "!!python")),
    ],
    ids=["malformed", "python_tag"],
)
def test_a_bad_yaml_config_file_is_one_line(text, needles, tmp_path, cache, monkeypatch, capsys):
    """A ``--config-name`` file that is not YAML, or that holds a ``!!python/`` tag: main printed a
    yaml traceback. Now one line naming the file, exit 1; nothing runs."""
    from posformer.cli.train import main

    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "broken.yaml").write_text("defaults:\n  - train\n  - _self_\n" + text)
    argv = ["posformer-train", f"--config-dir={configs}", "--config-name=broken", *TINY]
    argv += [f"hydra.run.dir={tmp_path / 'run'}", f"paths.cache_dir={cache}"]
    code, out = call(main, argv, monkeypatch, capsys)
    one_clear_line(code, out, 1, *needles)
    assert not (tmp_path / "pwned").exists()
