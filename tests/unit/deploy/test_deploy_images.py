"""The images' Dockerfiles and build context, read as an engine reads them.

`make compose-smoke` builds and runs them for real (bench/results/compose_cpu.json); these
checks hold the properties that smoke relies on without an engine: no registry but the base
image, a root .dockerignore that keeps the context small, the CA bundle and wheels only in the
build stage.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = sorted((ROOT / "deploy").glob("Dockerfile*"))


def _dockerignore_rules() -> list[tuple[bool, str]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        rules.append((neg, line.lstrip("!").rstrip("/")))
    return rules


def _regex(pattern: str) -> re.Pattern:
    """Docker's pattern syntax: ``**`` any number of directories, ``*`` and ``?`` within one."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _matches(pattern: str, path: str) -> bool:
    """A pattern matches the path or any of its parent directories (what excludes a folder's files)."""
    rx, parts = _regex(pattern), path.split("/")
    return any(rx.match("/".join(parts[:i])) for i in range(1, len(parts) + 1))


def in_context(path: str) -> bool:
    """Whether the engine sends ``path`` (relative to the repository root): the last matching rule wins."""
    included = True
    for neg, pattern in _dockerignore_rules():
        if _matches(pattern, path):
            included = neg
    return included


@pytest.mark.parametrize("path", [
    ".venv/bin/python", ".venv/lib/python3.11/site-packages/torch/__init__.py", ".git/HEAD", ".git/objects/ab/cd",
    ".pytest_cache/v/cache/nodeids", "connector/__pycache__/protocol.cpython-311.pyc", "bench/results/soak_cpu.json",
    ".demo/acceptance.json", "tests/unit/connector/test_protocol.py", "docs/deploy.md", "deploy/.env", ".gpu/p1",
    "build/lib/connector/x.py", "dist/hidden_state_stream-0.1.0-py3-none-any.whl",
])
def test_the_build_context_leaves_out(path):
    assert not in_context(path), f".dockerignore sends {path}"


def test_the_build_context_holds_every_file_the_dockerfiles_copy():
    copied = []
    for f in DOCKERFILES:
        for m in re.finditer(r"^COPY (?!--from)(.+?) \S+$", f.read_text(), re.M):
            copied += m.group(1).split()
    assert copied
    for src in copied:
        src = src.rstrip("/")
        if src == ".":
            continue  # the whole context: what .dockerignore sends, by definition
        target = ROOT / src
        assert target.exists(), f"{src} is copied but not in the repository"
        files = [target] if target.is_file() else [p for p in target.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        for p in files:
            rel = p.relative_to(ROOT).as_posix()
            if rel.startswith("deploy/build-inputs/") and p.name != "README.md":
                continue  # git-ignored inputs: present only where a build placed them
            assert in_context(rel), f"{rel} is copied by a Dockerfile but .dockerignore leaves it out"


def test_the_packaged_sources_are_all_in_the_context():
    tracked = subprocess.run(["git", "ls-files", "connector", "server", "trainer_client", "hsstream"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert tracked
    missing = [p for p in tracked if not in_context(p)]
    assert not missing, missing


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_no_dockerfile_needs_a_registry_for_its_front_end(dockerfile):
    # `# syntax=…` makes BuildKit pull a front-end image from a registry before building.
    assert not re.search(r"^#\s*syntax\s*=", dockerfile.read_text(), re.M | re.I)


def test_the_cpu_image_takes_its_base_and_torch_source_as_build_arguments():
    text = (ROOT / "deploy" / "Dockerfile.cpu").read_text()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms and all(f == "${BASE_IMAGE}" for f in froms), froms
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M) and re.search(r"^ARG TORCH_CPU_INDEX_URL=", text, re.M)
    assert "python3 -m venv" in text, "Debian's python3 refuses system-wide pip installs (PEP 668)"
    assert not re.search(r"(^|\s)python\s", text.replace("python3", "")), "Debian images have no `python`"


def test_the_ca_bundle_and_the_wheels_stay_in_the_build_stage():
    text = (ROOT / "deploy" / "Dockerfile.cpu").read_text()
    final = text[text.rindex("\nFROM "):]
    assert "build-inputs" not in final and "PIP_CERT" not in final and "ca.pem" not in final


def test_a_compose_v1_builder_sees_the_root_dockerignore():
    # Compose v1's classic builder reads <context>/.dockerignore only, not per-Dockerfile files.
    assert not list((ROOT / "deploy").glob("*.dockerignore"))
    assert in_context("pyproject.toml") and in_context("deploy/install_torch.py")
