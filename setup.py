"""Maps the repository's top-level folders into the `smart_epp` namespace.

The folder names (epp/, proto/, ...) are generic; installed under `smart_epp.` they
cannot shadow, or be shadowed by, another distribution's top-level package.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
FOLDERS = ("epp", "proto", "scorers", "kv_index", "benchmarks")

packages: list[str] = []
package_dir: dict[str, str] = {}
package_data: dict[str, list[str]] = {}
for folder in FOLDERS:
    for init in sorted((ROOT / folder).rglob("__init__.py")):
        rel = init.parent.relative_to(ROOT)
        name = "smart_epp." + ".".join(rel.parts)
        packages.append(name)
        package_dir[name] = rel.as_posix()
        package_data[name] = ["*.yaml", "*.jinja", "*.json", "*.txt"]

setup(packages=packages, package_dir=package_dir, package_data=package_data)
