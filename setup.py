"""Installs the repository root as the `smart_epp` package.

The folder names (epp/, proto/, ...) are generic; installed under `smart_epp.` they
cannot shadow, or be shadowed by, another distribution's top-level package. Inside the
package, modules import each other relatively, so tools that read the tree as it stands
see the same structure as the interpreter.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
FOLDERS = ("framework", "epp", "proto", "scorers", "kv_index", "benchmarks")

packages = ["smart_epp"]
package_dir = {"smart_epp": "."}
package_data: dict[str, list[str]] = {}
for folder in FOLDERS:
    for init in sorted((ROOT / folder).rglob("__init__.py")):
        rel = init.parent.relative_to(ROOT)
        name = "smart_epp." + ".".join(rel.parts)
        packages.append(name)
        package_data[name] = ["*.yaml", "*.jinja", "*.json", "*.txt"]


class BuildPy(build_py):
    """The root folder is the package, but this build script is not one of its modules."""

    def find_package_modules(self, package, package_dir):  # type: ignore[no-untyped-def]
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "smart_epp" and m[1] == "setup")]


setup(
    packages=packages,
    package_dir=package_dir,
    package_data=package_data,
    cmdclass={"build_py": BuildPy},
)
