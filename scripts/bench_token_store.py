"""Build the token store of generated corpora and time it next to a plain streaming uint16 write.

    python scripts/bench_token_store.py                          # 64 MB, 256 MB, 1 GB; BPE on 64 MB
    python scripts/bench_token_store.py --sizes 64 --bpe-size 64 --workdir /tmp/bench_store

For each size a pseudo-English corpus (words of a Zipf-distributed vocabulary, lines of 8-20 words, a
blank line every few lines) is written once into ``--workdir``. Each case runs as its own process
(imports included), pinned to the cores named, with a fresh cache; wall time from outside, peak memory
as the largest sum of the proportional set sizes (PSS) of the process and its children (for one
process PSS is its RSS less the share of pages other processes map too; forked workers' shared pages
count once), sampled from /proc every 20 ms, slowing to every 200 ms over a long run (sampling costs
CPU). ``--repeat N``: the median of N runs of each case. Cases:

- ``plain``: read the file in 16 MB chunks, widen the bytes to uint16, append them to a file (the least
  any byte-level store could do);
- ``byte``: ``posformer.data.build_datamodule`` with ``data=text data.tokenizer=byte`` (the store:
  scan, tokenise, shards, index);
- ``bpe/1`` and ``bpe/2``: the same with a byte-level BPE ``tokenizer.json`` (GPT-2's layout, trained
  here on the first 8 MB of the corpus, 16,384 tokens) and ``data.num_proc`` 1 and 2 (the 2-process case
  on cores ``--cores2``: it needs both to be free);
- ``--loader-size MB``: training windows read through a DataLoader from the store, and from the same
  tokens as one memory-mapped ``.npy`` (the stream before the store);
- ``--pairs N,...``: ``data=translation`` on generated parallel corpora of N pairs (a joint BPE of
  8,000 tokens), its build time and peak memory.

Prints a Markdown table: the process' wall seconds (Python start and imports included: posformer's
import of torch and Lightning is ~4 s of it), the work's seconds (measured inside the process, around
the write or ``build_datamodule``), peak memory (all processes of the case together), tokens/s of the
work, and the ratio of work seconds to the plain write of the same bytes (BPE on 2 processes: to BPE
on 1, so the ratio is the inverse speed-up).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PLAIN = """
import json, os, sys, time, numpy as np
start = time.perf_counter()
with open(sys.argv[1], "rb") as src, open(sys.argv[2], "wb") as dst:
    for chunk in iter(lambda: src.read(16 << 20), b""):
        dst.write(np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16).tobytes())
    dst.flush()
    os.fsync(dst.fileno())
print(json.dumps({"seconds": time.perf_counter() - start}))
"""
STORE = """
import json, sys, time
from posformer.data import build_datamodule
cfg = json.loads(sys.argv[1])
start = time.perf_counter()
dm = build_datamodule(cfg, "decoder", 0)
seconds = time.perf_counter() - start
print(json.dumps({"train": len(dm.train_stream), "val": len(dm.val_stream), "seconds": seconds}))
"""


LOADER = """
import json, sys, tempfile, time
import numpy as np
from torch.utils.data import DataLoader
from posformer.data import build_datamodule
from posformer.data.base import ResumableSampler
from posformer.data.lm import WindowDataset, collate_lm
cfg = json.loads(sys.argv[1])
dm = build_datamodule(cfg, "decoder", 0)
out = {"shards": len(dm.train_stream.records)}
old = tempfile.NamedTemporaryFile(suffix=".npy")  # the stream before the store: one .npy, memory-mapped
np.save(old.name, np.asarray(dm.train_stream))
for name, stream in (("store", dm.train_stream), ("npy", np.load(old.name, mmap_mode="r"))):
    data = WindowDataset(stream, 256)
    loader = DataLoader(data, batch_size=32, sampler=ResumableSampler(len(data), 0), collate_fn=collate_lm)
    start, n = time.perf_counter(), 0
    for i, batch in enumerate(loader):
        n += batch["input_ids"].numel()
        if i == 3000:
            break
    out[name] = n / (time.perf_counter() - start)
print(json.dumps(out))
"""
PAIRS = """
import json, sys, time
from posformer.data import build_datamodule
cfg = json.loads(sys.argv[1])
start = time.perf_counter()
dm = build_datamodule(cfg, "encoder_decoder", 0)
seconds = time.perf_counter() - start
print(json.dumps({"pairs": len(dm.corpora["train"]), "batches": dm.num_train_batches(), "seconds": seconds}))
"""


def write_pairs(folder: Path, n: int, seed: int = 0) -> None:
    """``n`` pseudo sentence pairs per ``train.{de,en}`` (and 1,000 for val, test), written in chunks."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = [
        f"{a}{b}" for a in ("ka", "mo", "ri", "te", "su", "lo", "ne", "pa") for b in ("n", "t", "s", "r", "l")
    ]
    for split, count in (("train", n), ("val", 1000), ("test", 1000)):
        with open(folder / f"{split}.de", "w") as de, open(folder / f"{split}.en", "w") as en:
            for start in range(0, count, 100_000):
                m = min(100_000, count - start)
                lengths = rng.integers(5, 30, size=m)
                words = rng.integers(0, len(vocab), size=int(lengths.sum()))
                de_lines, en_lines, k = [], [], 0
                for length in lengths.tolist():
                    sentence = [vocab[w] for w in words[k : k + length].tolist()]
                    de_lines.append(" ".join(sentence) + ".\n")
                    en_lines.append(" ".join(reversed(sentence)) + ".\n")
                    k += length
                de.write("".join(de_lines))
                en.write("".join(en_lines))


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> None:
    """``megabytes`` MB of pseudo-English text, written in chunks (never held whole)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    weights = 1.0 / np.arange(1, 27) ** 0.7
    p = weights / weights.sum()
    vocab = ["".join(rng.choice(letters, size=rng.integers(2, 9), p=p)) for _ in range(8000)]
    zipf = 1.0 / np.arange(1, len(vocab) + 1)
    zipf /= zipf.sum()
    target, written = megabytes << 20, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            words = rng.choice(len(vocab), size=400_000, p=zipf)
            lengths = rng.integers(8, 21, size=len(words) // 8)
            lines, start = [], 0
            for i, n in enumerate(lengths.tolist()):
                line = " ".join(vocab[w] for w in words[start : start + n].tolist())
                lines.append(line.capitalize() + (".\n\n" if i % 5 == 4 else ".\n"))
                start += n
            text = "".join(lines)[: target - written]
            f.write(text)
            written += len(text)


def train_bpe(corpus: Path, out: Path, vocab_size: int = 16384) -> Path:
    """A GPT-2-style byte-level BPE tokenizer.json trained on the first 8 MB of ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    file = out / "tokenizer.json"
    if file.is_file():
        return file
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    with open(corpus, encoding="utf-8") as f:
        sample = f.read(8 << 20).splitlines(keepends=True)
    tok.train_from_iterator(sample, trainer=trainer)
    tok.save(str(file))
    return file


def tree_memory(pid: int) -> int:
    """Bytes of memory of ``pid`` and every descendant: the sum of their proportional set sizes (PSS,
    /proc/<pid>/smaps_rollup: a page shared by forked workers counts once in the sum, not once each)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(ln.split()[1]) << 10 for ln in f if ln.startswith("Pss:"))
        except (OSError, IndexError, ValueError, StopIteration):
            pass
    return total


REPEAT = 1  # runs of each case (--repeat): the median of the times, the largest memory


def run(
    cmd: list[str], cores: set[int], env: dict[str, str], fresh: Path | None = None
) -> dict[str, float | str]:
    """:func:`run_once` :data:`REPEAT` times (``fresh``: a cache removed before each): the median wall
    and work seconds, the largest memory."""
    runs = []
    for _ in range(REPEAT):
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
        runs.append(run_once(cmd, cores, env))
    out = dict(runs[len(runs) // 2])
    out["wall"] = float(np.median([r["wall"] for r in runs]))
    out["rss_mb"] = max(float(r["rss_mb"]) for r in runs)
    seconds = [json.loads(str(r["out"])).get("seconds") for r in runs if str(r["out"]).startswith("{")]
    if seconds and None not in seconds:
        out["out"] = json.dumps({**json.loads(str(out["out"])), "seconds": float(np.median(seconds))})
    return out


def run_once(cmd: list[str], cores: set[int], env: dict[str, str]) -> dict[str, float | str]:
    """Wall seconds and peak memory (of the process and its children together) of ``cmd`` on ``cores``."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_memory(proc.pid))
        time.sleep(min(0.2, 0.02 + (time.perf_counter() - start) / 100))  # 20 ms at first, 200 ms past 18 s
    wall = time.perf_counter() - start
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"wall": wall, "rss_mb": peak / 2**20, "out": out.strip().splitlines()[-1] if out.strip() else ""}


def store_case(
    corpus: Path, cache: Path, tokenizer: str, num_proc: int, cores: set[int], env: dict[str, str]
) -> dict[str, float | str]:
    """The store of ``corpus`` built in a fresh cache by one process (``num_proc`` tokenising)."""
    shutil.rmtree(cache, ignore_errors=True)
    cfg = {
        "name": "text",
        "path": str(corpus),
        "tokenizer": tokenizer,
        "num_proc": num_proc,
        "cache_dir": str(cache),
        "block_size": 256,
    }
    res = run([sys.executable, "-c", STORE, json.dumps(cfg)], cores, env, fresh=cache)
    counts = json.loads(str(res["out"]))
    res["tokens"], res["seconds"] = counts["train"] + counts["val"], counts["seconds"]
    shutil.rmtree(cache, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,256,1024", help="corpus sizes in MB (byte tokenizer vs plain)")
    ap.add_argument("--bpe-size", type=int, default=64, help="corpus size in MB of the BPE cases (0: none)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_token_store"))
    ap.add_argument("--loader-size", type=int, default=0, help="corpus MB of the loader case (0: none)")
    ap.add_argument("--pairs", default="", help="parallel corpora of these many pairs (e.g. 450000,4500000)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each case: the median time")
    ap.add_argument("--cores1", default="1", help="cores of the one-process cases")
    ap.add_argument("--cores2", default="0,1", help="cores of the two-process case")
    args = ap.parse_args()
    global REPEAT
    REPEAT = max(1, args.repeat)
    cores1 = {int(c) for c in args.cores1.split(",")}
    cores2 = {int(c) for c in args.cores2.split(",")}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for mb in [int(s) for s in args.sizes.split(",") if s]:
        corpus = args.workdir / f"corpus_{mb}mb.txt"
        if not corpus.is_file():
            write_corpus(corpus, mb)
        plain = run([sys.executable, "-c", PLAIN, str(corpus), str(args.workdir / "plain.u16")], cores1, env)
        plain["seconds"] = json.loads(str(plain["out"]))["seconds"]
        (args.workdir / "plain.u16").unlink()
        byte = store_case(corpus, args.workdir / "cache", "byte", 1, cores1, env)
        rows.append((f"{mb} MB", "plain uint16 write", plain, None, cores1))
        rows.append((f"{mb} MB", "store, byte, 1 process", byte, plain["seconds"], cores1))
    if args.bpe_size:
        corpus = args.workdir / f"corpus_{args.bpe_size}mb.txt"
        if not corpus.is_file():
            write_corpus(corpus, args.bpe_size)
        tok = train_bpe(corpus, args.workdir / "bpe")
        repeat, REPEAT = REPEAT, 1  # the two cases in turn (1 2 1 2 ...), so a busy moment hits both
        cases = ((1, cores1), (2, cores2))
        runs = [
            [store_case(corpus, args.workdir / "cache", str(tok), n, c, env) for n, c in cases]
            for _ in range(repeat)
        ]
        REPEAT = repeat
        one, two = (sorted(case, key=lambda r: float(r["seconds"]))[len(case) // 2] for case in zip(*runs))
        rows.append((f"{args.bpe_size} MB", "store, BPE 16k, 1 process", one, None, cores1))
        rows.append((f"{args.bpe_size} MB", "store, BPE 16k, 2 processes", two, one["seconds"], cores2))
    if args.loader_size:
        corpus = args.workdir / f"corpus_{args.loader_size}mb.txt"
        if not corpus.is_file():
            write_corpus(corpus, args.loader_size)
        cache = args.workdir / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        cfg = {
            "name": "text",
            "path": str(corpus),
            "tokenizer": "byte",
            "cache_dir": str(cache),
            "block_size": 256,
        }
        loader = json.loads(str(run([sys.executable, "-c", LOADER, json.dumps(cfg)], cores1, env)["out"]))
        shutil.rmtree(cache, ignore_errors=True)
    pair_rows = []
    for n in [int(s) for s in args.pairs.split(",") if s]:
        folder = args.workdir / f"pairs_{n}"
        if not (folder / "test.en").is_file():
            write_pairs(folder, n)
        cache = args.workdir / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        cfg = {
            "name": "translation",
            "path": str(folder),
            "vocab_size": 8000,
            "max_tokens": 4096,
            "cache_dir": str(cache),
            "splits": {"train": "train", "val": "val", "test": "test"},
        }
        res = run([sys.executable, "-c", PAIRS, json.dumps(cfg)], cores1, env)
        res.update(json.loads(str(res["out"])))
        pair_rows.append((n, res))
        shutil.rmtree(cache, ignore_errors=True)
    print("| corpus | case | cores | process wall s | work s | peak memory (PSS) | tokens/s | ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for size, case, res, ref, cores in rows:
        rate = f"{res['tokens'] / res['seconds']:,.0f}" if "tokens" in res else ""
        ratio = f"{res['seconds'] / ref:.2f}x" if ref else ""
        cpus = ",".join(map(str, sorted(cores)))
        times, rss = f"{res['wall']:.1f} | {res['seconds']:.1f}", f"{res['rss_mb']:,.0f} MB"
        print(f"| {size} | {case} | {cpus} | {times} | {rss} | {rate} | {ratio} |")
    if args.loader_size:
        print(
            f"\ntraining windows (256 tokens, batches of 32) read from the store of {args.loader_size} MB "
            f"({loader['shards']} shards): {loader['store']:,.0f} tokens/s; from the same tokens as one "
            f"memory-mapped .npy (the stream before the store): {loader['npy']:,.0f} tokens/s "
            f"({loader['store'] / loader['npy']:.2f}x)"
        )
    if pair_rows:
        print("\n| sentence pairs | process wall s | build s | peak memory (PSS) |\n|---:|---:|---:|---:|")
        for n, res in pair_rows:
            print(f"| {n:,} | {res['wall']:.0f} | {res['seconds']:.0f} | {res['rss_mb']:,.0f} MB |")


if __name__ == "__main__":
    main()
