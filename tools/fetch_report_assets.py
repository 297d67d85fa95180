"""Re-fetch the JavaScript the HTML report and explorer inline, from the npm registry.

    python tools/fetch_report_assets.py                      # the versions in VERSIONS below
    python tools/fetch_report_assets.py vega@6.4.0 vega-lite@6.5.0 vega-embed@7.3.0

Needs ``npm`` (it runs ``npm pack``, which downloads the published tarball and checks its
integrity against the registry). Copies each package's minified browser build and its LICENSE
into ``tensorlens/reports/assets/`` and writes ``assets/VERSIONS.json``. Review the diff, then run
``pytest tests/reports`` (the browser tests load the report with the new files).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

#: package -> (version, minified build inside the tarball)
VERSIONS = {
    "vega": ("6.4.0", "package/build/vega.min.js"),
    "vega-lite": ("6.5.0", "package/build/vega-lite.min.js"),
    "vega-embed": ("7.3.0", "package/build/vega-embed.min.js"),
}
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tensorlens", "reports", "assets")


def fetch(package: str, version: str, build: str, into: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["npm", "pack", "--silent", f"{package}@{version}", "--pack-destination", tmp],
            check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
        with tarfile.open(os.path.join(tmp, out)) as tar:
            members = {m.name: m for m in tar.getmembers()}
            script = tar.extractfile(members[build]).read()
            license_text = tar.extractfile(members["package/LICENSE"]).read()
            manifest = json.loads(tar.extractfile(members["package/package.json"]).read())
    if b"</script" in script.lower():
        raise RuntimeError(f"{package}'s build contains '</script': it cannot be inlined as is")
    name = os.path.basename(build)
    with open(os.path.join(into, name), "wb") as f:
        f.write(script)
    with open(os.path.join(into, f"{package}.LICENSE.txt"), "wb") as f:
        f.write(license_text)
    return {"version": manifest["version"], "file": name, "license": manifest.get("license", "")}


def main(argv: list[str]) -> int:
    if shutil.which("npm") is None:
        print("npm is needed: apt-get install npm (or install Node.js)", file=sys.stderr)
        return 1
    wanted = dict(VERSIONS)
    for spec in argv:
        package, _, version = spec.rpartition("@")
        if package not in wanted:
            print(f"unknown package {package!r}; known: {sorted(wanted)}", file=sys.stderr)
            return 2
        wanted[package] = (version, wanted[package][1])
    versions = {package: fetch(package, version, build, ASSETS) for package, (version, build) in wanted.items()}
    with open(os.path.join(ASSETS, "VERSIONS.json"), "w", encoding="utf-8") as f:
        json.dump(versions, f, indent=2)
        f.write("\n")
    for package, info in versions.items():
        print(f"{package} {info['version']} -> {info['file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
