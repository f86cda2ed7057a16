"""posformer-inspect: tables, PNGs and override parsing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from posformer.cli.inspect import main, parse_overrides
from posformer.errors import ConfigError
from posformer.pe import list_encodings

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def printed_table(text: str) -> dict[int, float]:
    """``offset k -> value`` rows of the first two-column table in ``text``."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\s*│\s*(\d+)\s*│\s*(-?[\d.]+)\s*│\s*$", line)
        if m:
            rows.setdefault(int(m.group(1)), float(m.group(2)))
    return rows


@pytest.mark.parametrize("pe", list_encodings())
def test_runs_for_every_pe_and_writes_pngs(pe: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([f"pe={pe}", "d_model=32", "n_heads=2", "max_len=64", f"out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    written = sorted(p.name for p in tmp_path.glob("*.png"))
    expected = {"position_logits_mean.png", "position_logits_heads.png"}
    if pe in ("sinusoidal", "learned"):
        expected |= {"pe_matrix.png", "cosine_similarity.png"}
    assert set(written) == expected
    for name in written:
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
        assert str(tmp_path / name) in out.replace("\n", "")
    assert "position-only logit by offset" in out


def test_sinusoidal_cosine_similarity_decays_with_offset(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    main(["pe=sinusoidal", "d_model=512", "max_len=512", "offsets=[3,300]", f"out_dir={tmp_path}"])
    out = capsys.readouterr().out
    cos = printed_table(out.split("cos-sim PE(p)·PE(p+k)")[1].split("wavelength")[0])
    assert set(cos) == {1, 2, 3, 5, 10, 50, 100, 200, 300}
    assert cos[1] > cos[200]
    assert 0.95 < cos[1] < 1.0
    assert "wavelength" in out and "60,611.5" in out  # 2π·10000^(510/512), the last pair


def test_rope_wavelengths_follow_the_base(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    main(["pe=rope", "d_model=64", "n_heads=4", "max_len=32", "pe_options.base=100", f"out_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "6.3" in out and f"{2 * 3.14159265 * 100 ** (14 / 16):,.1f}" in out  # pair 7 of 8


def test_overrides_merge_over_the_pe_config() -> None:
    cfg = parse_overrides(["pe=rope", "pe_options.base=500", "offsets=[7]"])
    assert cfg.pe_options.base == 500 and cfg.pe_options.layout == "half" and list(cfg.offsets) == [7]


def test_bad_overrides_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="'nosuch'"):
        parse_overrides(["pe=nosuch"])
    with pytest.raises(ConfigError, match=r"\['dmodel'\].*d_model"):
        parse_overrides(["dmodel=5"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["rope"])


@pytest.mark.slow  # a subprocess
def test_module_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "posformer.cli.inspect",
            "pe=nope",
            "d_model=8",
            "n_heads=1",
            "max_len=4",
            f"out_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "position_logits_mean.png").exists()
