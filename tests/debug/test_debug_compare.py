"""``shardtrain compare``: no divergence for identical runs, the planted bug found exactly, bf16 vs fp32, HTML."""

from __future__ import annotations

import base64
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from shardtrain.cli import main
from shardtrain.debug.records import compare_runs, load_run

from helpers.debug_runs import ScaleOutput, train_plain

PLANTED = "blocks.1.mlp.0"  # the first linear layer of the second block's MLP


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    paths = {name: root / name for name in ("a", "a_again", "planted", "bf16")}
    train_plain(paths["a"])
    train_plain(paths["a_again"])
    train_plain(paths["planted"], extra=[ScaleOutput(PLANTED, 1.001, from_step=3)])
    train_plain(paths["bf16"], dtype=torch.bfloat16)
    return paths


def test_identical_seeds_do_not_diverge(runs, capsys):
    assert main(["compare", str(runs["a"]), str(runs["a_again"])]) == 0
    out = capsys.readouterr().out
    assert "no divergence" in out and "FIRST DIVERGENCE" not in out
    c = compare_runs(load_run(runs["a"]), load_run(runs["a_again"]), 0.0, 0.0)
    assert c.first_step is None and all(d.worst.rel == 0.0 for d in c.diffs)  # bit-identical, even at rtol 0


def test_planted_perturbation_is_found_at_its_step_and_module(runs, capsys):
    assert main(["compare", str(runs["a"]), str(runs["planted"])]) == 1
    out = capsys.readouterr().out
    assert "FIRST DIVERGENCE at step 3" in out
    assert f"first diverging activation (execution order): forward {PLANTED}\n" in out
    c = compare_runs(load_run(runs["a"]), load_run(runs["planted"]), 1e-4, 0.0)
    first = c.first_divergence()
    assert c.first_step == 3 and first.key[2:5] == ("forward", PLANTED, "")
    assert all(d.worst.rel == 0.0 for d in c.diffs if d.step < 3)
    # scaling by 1.001 scales std, norm, min and max by that factor (up to fp32 rounding of the product)
    by_stat = {s.stat: s for s in first.stats}
    for stat in ("std", "norm", "min", "max"):
        assert by_stat[stat].b == pytest.approx(by_stat[stat].a * 1.001, rel=1e-6), stat
    assert by_stat["norm"].rel == pytest.approx(1e-3 / 1.001, rel=1e-4)
    # everything that runs before the planted module at step 3 is still identical
    earlier = [d for d in c.at_step(3) if d.order() < first.order()]
    assert earlier and all(not d.above for d in earlier)
    for line in ("step     0          0  ok", "step     3"):
        assert line in out


def test_tolerance_decides_the_verdict(runs, capsys):
    assert main(["compare", str(runs["a"]), str(runs["planted"]), "--rtol", "0.05"]) == 0
    assert main(["compare", str(runs["a"]), str(runs["planted"]), "--rtol", "0", "--atol", "1e3"]) == 0
    capsys.readouterr()


def test_bf16_against_fp32_diverges_with_plausible_magnitudes(runs, capsys):
    assert main(["compare", str(runs["a"]), str(runs["bf16"])]) == 1
    out = capsys.readouterr().out
    assert "dtype differs in" in out and "float32 in A, bfloat16 in B" in out
    c = compare_runs(load_run(runs["a"]), load_run(runs["bf16"]), 1e-4, 0.0)
    assert c.first_step == 0
    assert c.first_divergence().key[2:4] == ("forward", "tok")  # the embedding output is the first bf16 rounding
    # bf16 keeps 8 significant bits (relative spacing 2**-8 = 0.0039): norms differ by about that, not 1e-8, not 1
    norms = sorted(s.rel for d in c.at_step(0) for s in d.stats if s.stat == "norm")
    median = norms[len(norms) // 2]
    assert 1e-4 < median < 2e-2, norms
    assert max(d.worst.rel for d in c.diffs) < 0.5


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.external: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        for key in ("src", "href"):
            if attrs.get(key, "").startswith(("http:", "https:", "//")):
                self.external.append(attrs[key])


def test_html_report_is_self_contained_with_plots(runs, tmp_path, capsys):
    out_dir = tmp_path / "report"
    assert main(["compare", str(runs["a"]), str(runs["planted"]), "--out", str(out_dir)]) == 1
    html = (out_dir / "report.html").read_text(encoding="utf-8")
    parser = _Images()
    parser.feed(html)
    parser.close()
    assert parser.tags[:1] == ["html"] and "script" not in parser.tags and not parser.external
    assert len(parser.images) == 3  # per-step differences, heat map, both runs' curves
    for src in parser.images:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)
        png = base64.b64decode(src[len(prefix) :], validate=True)
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    assert "FIRST DIVERGENCE at step 3" in html and PLANTED in html
    capsys.readouterr()


def test_records_or_steps_present_in_one_run_only(runs, tmp_path, capsys):
    shorter = tmp_path / "shorter"
    shutil.copytree(runs["a"], shorter)
    for step in (4, 5):
        (shorter / "rank_0" / f"step_{step:06d}.jsonl").unlink()
    assert main(["compare", str(shorter), str(runs["a_again"])]) == 0  # a longer run is not a divergence
    assert "steps only in B (not compared): 4-5" in capsys.readouterr().out

    pruned = tmp_path / "pruned"
    shutil.copytree(runs["a"], pruned)
    step2 = pruned / "rank_0" / "step_000002.jsonl"
    lines = step2.read_text().splitlines(keepends=True)
    step2.write_text("".join(lines[:3] + lines[4:]))  # drop the fourth forward record of step 2
    assert main(["compare", str(runs["a"]), str(pruned)]) == 1
    out = capsys.readouterr().out
    assert "only in A: step 2 forward blocks.0.attn.qkv" in out and "FIRST DIVERGENCE at step 2" in out


def test_bad_input_is_a_clear_error(runs, tmp_path, capsys):
    assert main(["compare", str(tmp_path / "nope"), str(runs["a"])]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(runs["a"]), str(tmp_path / "empty")]) == 2
    assert "no statistics records" in capsys.readouterr().err
    broken = tmp_path / "broken" / "rank_0"
    broken.mkdir(parents=True)
    (broken / "step_000000.jsonl").write_text('{"dir": "forward"}\n')
    assert main(["compare", str(runs["a"]), str(tmp_path / "broken")]) == 2
    assert "step_000000.jsonl:1: not a statistics record" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")
    assert main(["compare", str(runs["a"]), str(runs["a"]), "--out", str(tmp_path / "a_file")]) == 2
    assert "cannot write the HTML report" in capsys.readouterr().err
    for flag, value in (("--rtol", "-1"), ("--atol", "nan"), ("--rtol", "abc")):
        with pytest.raises(SystemExit) as exc:
            main(["compare", str(runs["a"]), str(runs["a"]), flag, value])
        assert exc.value.code == 2
        assert flag in capsys.readouterr().err


def test_python_dash_m_entry_point(runs):
    done = subprocess.run(
        [sys.executable, "-m", "shardtrain", "compare", str(runs["a"]), str(runs["planted"])],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1 and "FIRST DIVERGENCE at step 3" in done.stdout
