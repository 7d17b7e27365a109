"""The Dockerfile, read with the official BuildKit parser (the `dockerfile` package): a
multi-stage build on a pinned slim Python base, a final stage with no build tooling that
runs `epp` as an unprivileged user, the picker's ports exposed, every package folder in
the build context, and no secrets. (No image is built here: that needs a Docker daemon.)"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

import dockerfile
from support.paths import REPO

from smart_epp.epp.cli import build_parser

# A full version (python:3.12.11-slim-bookworm), a digest, or both; `python:3-slim` is not.
PINNED = re.compile(
    r"^[\w./-]+(:\d+\.\d+\.\d+[\w.-]*(@sha256:[0-9a-f]{64})?|@sha256:[0-9a-f]{64})$"
)
SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|API_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)
BUILD_TOOLS = re.compile(r"\b(apt-get|apt|apk|yum|dnf|gcc|g\+\+|make|build-essential|pip)\b")


@dataclass
class Stage:
    base: str
    name: str | None
    commands: list[dockerfile.Command] = field(default_factory=list)

    def of(self, instruction: str) -> list[dockerfile.Command]:
        return [c for c in self.commands if c.cmd == instruction]


def stages() -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults and the stages, each with its resolved base image."""
    args: dict[str, str] = {}
    found: list[Stage] = []
    for command in dockerfile.parse_file(str(REPO / "Dockerfile")):
        if command.cmd == "ARG" and not found:
            name, _, default = command.value[0].partition("=")
            args[name] = default
        elif command.cmd == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], command.value[0])
            name = command.value[2] if len(command.value) == 3 else None
            found.append(Stage(image, name))
        elif found:
            found[-1].commands.append(command)
    return args, found


def test_multi_stage_on_a_pinned_slim_python_base() -> None:
    _, all_stages = stages()
    assert len(all_stages) >= 2
    names = {s.name for s in all_stages}
    for stage in all_stages:
        if stage.base in names:
            continue  # built on an earlier stage
        assert PINNED.match(stage.base), f"base image not pinned: {stage.base}"
        assert stage.base.startswith("python:") and "slim" in stage.base, stage.base


def test_final_stage_runs_epp_unprivileged_without_build_tools() -> None:
    *_, final = stages()[1]
    [user] = final.of("USER")
    assert user.value[0].split(":")[0] not in ("0", "root")
    assert final.of("ENTRYPOINT")[-1].value == ("epp",)
    assert final.of("CMD")[-1].value == ("serve",)
    for run in final.of("RUN"):
        assert not BUILD_TOOLS.search(run.value[0]), run.original
    # Only the built virtual environment comes from the build stage.
    copies = final.of("COPY") + final.of("ADD")
    assert copies and all(c.flags == ("--from=build",) for c in copies)
    assert {c.value[0] for c in copies} == {"/opt/smart-epp"}


def test_picker_ports_are_exposed() -> None:
    *_, final = stages()[1]
    exposed = {int(p.split("/")[0]) for c in final.of("EXPOSE") for p in c.value}
    defaults = build_parser().parse_args(["serve"])
    assert {defaults.grpc_port, defaults.health_port, defaults.metrics_port} <= exposed


def test_no_secrets_in_the_image() -> None:
    args, all_stages = stages()
    names = list(args) + [
        c.value[i] for s in all_stages for c in s.of("ENV") for i in range(0, len(c.value), 2)
    ]
    names += [c.value[0].split("=")[0] for s in all_stages for c in s.of("ARG")]
    assert not [n for n in names if SECRET_NAME.search(n)]
    sources = [v for s in all_stages for c in s.of("COPY") + s.of("ADD") for v in c.value[:-1]]
    for source in sources:
        assert not re.search(r"(\.env|id_rsa|\.pem|\.key|credentials)", source), source


def package_folders() -> tuple[str, ...]:
    """setup.py's FOLDERS: the folders installed under `smart_epp.`."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "FOLDERS":
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("setup.py names no FOLDERS")


def test_build_context_holds_what_the_build_copies() -> None:
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*")] == "*", "the context is an allow-list"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    build = stages()[1][0]
    copied = [v.rstrip("/") for c in build.of("COPY") if not c.flags for v in c.value[:-1]]
    for source in copied:
        assert source in allowed, f"{source} is copied but left out of the build context"
        assert (REPO / source).exists(), source
    assert set(package_folders()) <= set(copied), "a package folder is missing from the image"
