"""The documentation stays true: its configs load, its commands parse, its links resolve.

Checked in README.md, CONTRIBUTING.md and docs/*.md (links also in benchmarks/README.md):

- every fenced ```yaml block is a job config and loads through the strict loader (``hftrain.config.load_config``),
  unless the line before it is ``<!-- not a job config -->`` (an accelerate config, a hostfile-like fragment):
  then it must still be valid YAML;
- every ```json block parses as JSON, and a DeepSpeed one equals a file in ``ds_configs/`` (an accelerate config
  block, one in ``accelerate_configs/``);
- every ```python block compiles;
- every command line in a ```bash block that runs hftrain (``hftrain ...``, ``-m hftrain ...``,
  ``scripts/train.py ...``) parses with hftrain's own argument parser without running; ``train``'s overrides go
  through the config loader, with the ``--config`` file read when it is in the repository;
- every relative link resolves to a file, and its ``#anchor`` to a heading of that file (GitHub's slugs).
"""

from __future__ import annotations

import json
import re
import shlex
import unicodedata
from pathlib import Path

import pytest
import yaml

from hftrain.cli import build_parser
from hftrain.config import load_config
from hftrain.errors import ConfigError
from hftrain.launch.args import translate_launcher_args

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*DOCS, ROOT / "benchmarks" / "README.md"]
NOT_A_JOB_CONFIG = "<!-- not a job config -->"
# Config paths the docs use as the reader's own file; they stand for "your job": the defaults plus the overrides.
PLACEHOLDER_CONFIGS = {"job.yaml", "my_job.yaml"}
HFTRAIN_COMMAND = re.compile(r"(?:^|\s)(?:\S*/)?(?:hftrain|-m hftrain|scripts/train\.py)(?=\s|$)")
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def fenced_blocks(path: Path) -> list[tuple[str, str, str, int]]:
    """``(language, text, line before the fence, line number)`` of every fenced block in a markdown file."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not match:
            i += 1
            continue
        indent, language, start = match.group(1), match.group(2), i
        before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i][len(indent) :])
            i += 1
        assert i < len(lines), f"{path.name}:{start + 1}: unclosed code fence"
        blocks.append((language, "\n".join(body), before, start + 1))
        i += 1
    return blocks


def _cases(language: str) -> list:
    return [
        pytest.param(path, text, before, id=f"{path.relative_to(ROOT)}:{line}")
        for path in DOCS
        if path.exists()
        for lang, text, before, line in fenced_blocks(path)
        if lang == language
    ]


@pytest.mark.parametrize(("path", "text", "before"), _cases("yaml"))
def test_yaml_blocks_are_job_configs(path, text, before, tmp_path):
    if before == NOT_A_JOB_CONFIG:
        loaded = yaml.safe_load(text)
        assert isinstance(loaded, dict), "a YAML block marked as not a job config is still a mapping"
        if "distributed_type" in loaded:  # an accelerate config: the one it shows must be a shipped one, verbatim
            shipped = [yaml.safe_load(f.read_text()) for f in sorted((ROOT / "accelerate_configs").glob("*.yaml"))]
            assert loaded in shipped, "an accelerate config block differs from every file in accelerate_configs/"
        return
    config_file = tmp_path / "block.yaml"
    config_file.write_text(text)
    load_config(config_file)  # raises ConfigError naming the key


@pytest.mark.parametrize(("path", "text", "before"), _cases("json"))
def test_json_blocks_parse(path, text, before):
    loaded = json.loads(text)
    if "zero_optimization" in loaded:  # a DeepSpeed config: the one it shows must be a shipped one, verbatim
        shipped = [json.loads(f.read_text()) for f in sorted((ROOT / "ds_configs").glob("*.json"))]
        assert loaded in shipped, "a DeepSpeed JSON block differs from every file in ds_configs/"


@pytest.mark.parametrize(("path", "text", "before"), _cases("python"))
def test_python_blocks_compile(path, text, before):
    compile(text, str(path), "exec")


def command_lines(text: str) -> list[str]:
    """The shell lines of a block that run hftrain, continuation lines joined and comments dropped."""
    joined, lines = "", []
    for raw in text.splitlines():
        joined += raw.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        line, joined = joined, ""
        words = shlex.split(line, comments=True)
        if words and HFTRAIN_COMMAND.search(" ".join(words)):
            lines.append(" ".join(shlex.quote(word) for word in words))
    return lines


def hftrain_argv(line: str) -> list[str]:
    """The arguments after ``hftrain`` (``scripts/train.py`` is ``hftrain train``) of one command line."""
    words = shlex.split(line)
    for i, word in enumerate(words):
        if word in ("scripts/train.py", "hftrain") or word.endswith("/hftrain"):
            rest = words[i + 1 :]
            for j, later in enumerate(rest):  # the command ends at a shell operator
                if later in ("&&", "||", "|", ";") or later.startswith(">"):
                    rest = rest[:j]
                    break
            return ["train", *rest] if word == "scripts/train.py" else rest
    raise AssertionError(f"no hftrain command in {line!r}")


def _command_cases() -> list:
    return [
        pytest.param(line, id=f"{path.relative_to(ROOT)}:{number}:{line[:60]}")
        for path in DOCS
        if path.exists()
        for lang, text, _, number in fenced_blocks(path)
        if lang in ("bash", "sh", "shell")
        for line in command_lines(text)
    ]


@pytest.mark.parametrize("line", _command_cases())
def test_hftrain_command_lines_parse(line, monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' paths (configs/, ds_configs/) are relative to the repository root
    argv = hftrain_argv(line)
    if argv[:1] == ["launch"]:  # torchrun's options, checked by its parser, then the hftrain command after --
        from torch.distributed.run import parse_args

        split = argv.index("--")
        parse_args([*argv[1:split], "--module", "hftrain"])
        argv = argv[split + 1 :]
    args, extra = build_parser().parse_known_args(argv)
    if args.command != "train":
        assert not extra, f"unrecognized arguments: {extra}"
        return
    config = args.config
    if config in PLACEHOLDER_CONFIGS:
        config = None
    elif config is not None:
        assert (ROOT / config).is_file(), f"--config {config}: no such file in the repository"
        config = ROOT / config
    launcher = translate_launcher_args(extra, {})  # --deepspeed ds.json and --local_rank, as `hftrain train` does
    launcher.apply(load_config(config, launcher.overrides))


def github_slugs(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file (duplicates numbered -1, -2, ...)."""
    seen: dict[str, int] = {}
    slugs = set()
    fence = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        match = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).lower()
        slug = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LMN").replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def relative_links(path: Path) -> list[str]:
    """Link targets outside code (fenced blocks and inline code) that are not URLs."""
    text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [a or b for a, b in LINK.findall(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def _link_cases() -> list:
    return [
        pytest.param(path, target, id=f"{path.relative_to(ROOT)}->{target}")
        for path in LINKED
        if path.exists()
        for target in relative_links(path)
    ]


@pytest.mark.parametrize(("path", "target"), _link_cases())
def test_relative_links_resolve(path, target):
    file_part, _, anchor = target.partition("#")
    resolved = (path.parent / file_part).resolve() if file_part else path
    assert resolved.exists(), f"{path.relative_to(ROOT)}: link to {target}: no such file"
    if anchor:
        assert resolved.suffix == ".md", f"{path.relative_to(ROOT)}: anchor into a non-markdown file: {target}"
        assert anchor in github_slugs(resolved), (
            f"{path.relative_to(ROOT)}: link to {target}: no such heading; headings: {sorted(github_slugs(resolved))}"
        )


def test_every_docs_page_is_checked_and_linked_from_the_readme():
    """No page escapes the checks above, and the README reaches every page."""
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"
    assert len(_cases("yaml")) > 0 and len(_command_cases()) > 0 and len(_link_cases()) > 0


def test_the_checks_catch_a_broken_link_and_a_bad_config(tmp_path):
    """The checks themselves fail on what they are meant to catch."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[gone](missing.md) [anchor](#no-such-heading) [ok](#title)\n")
    assert relative_links(page) == ["missing.md", "#no-such-heading", "#title"]
    assert "title" in github_slugs(page) and "no-such-heading" not in github_slugs(page)
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: {learnin_rate: 1e-4}\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(bad)
    with pytest.raises(ConfigError, match="strategy.name"):
        load_config(None, ["--strategy.nam", "zero3"])


def test_no_import_circle_and_no_import_from_a_lower_layer_to_a_higher_one(tmp_path):
    """docs/architecture.md's layering, held by scripts/check_layers.py (which fails on a planted upward import)."""
    import subprocess
    import sys

    script = ROOT / "scripts" / "check_layers.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout
    assert "import circles: 0" in result.stdout and "higher one: 0" in result.stdout
    # the check can fail: a copy of the tree where parallel/ imports the trainers
    import shutil

    shutil.copytree(ROOT / "hftrain", tmp_path / "hftrain")
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    (tmp_path / "hftrain" / "parallel" / "planted.py").write_text("from hftrain.trainers import base\n")
    planted = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "check_layers.py")], capture_output=True, text=True, check=False
    )
    assert planted.returncode == 1 and "hftrain.parallel.planted imports hftrain.trainers" in planted.stdout


def test_the_runtime_interface_is_what_architecture_md_lists():
    """``docs/architecture.md``'s runtime table names every public member of ``AccelerateRuntime`` (its methods and
    properties, and the attributes its constructor sets) and nothing else (issue 56: 35 members against 10 listed)."""
    import inspect

    from hftrain.strategies.runtime import AccelerateRuntime

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The runtime interface a strategy implements", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    source = inspect.getsource(AccelerateRuntime.__init__)
    members = {name for name in dir(AccelerateRuntime) if not name.startswith("_")}
    members |= {name for name in re.findall(r"self\.(\w+) =", source) if not name.startswith("_")}
    assert listed == members, f"not in the table: {sorted(members - listed)}; not members: {sorted(listed - members)}"
