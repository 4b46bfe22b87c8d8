"""Write the lease API's OpenAPI document (docs/lease-api.openapi.json) from the FastAPI app itself.

    .venv/bin/python scripts/lease_api_openapi.py          # write it
    .venv/bin/python scripts/lease_api_openapi.py --check  # exit 1 when the file is stale

tests/api/test_contract.py fails when the file is not what this writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "lease-api.openapi.json"


def document() -> dict[str, Any]:
    from airflow_lease_provider.plugins.lease_api import create_api

    spec = create_api().openapi()
    spec["servers"] = [{"url": "{base_url}/lease/v1", "variables": {"base_url": {"default": "http://localhost:8080"}}}]
    spec["info"]["version"] = "v1"  # the API's version, not the package's: the file changes with the API only
    spec.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer",
                   "description": "acquire, holders, waiters, wait/claim: the password of the connection "
                                  "lease_api; wait/release: the capability the place's claim answered; the other "
                                  "routes: the capability the acquire answered (docs/api.md)"},
    }
    spec["security"] = [{"bearer": []}]
    return spec


def text() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text() != text():
            print(f"{TARGET.relative_to(ROOT)} is stale: run scripts/lease_api_openapi.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text())
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
