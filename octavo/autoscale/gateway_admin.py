"""The gateway's admin API (docs/GATEWAY.md): the replicas it routes to."""
from __future__ import annotations

from typing import Optional

import httpx


class GatewayAdmin:
    def __init__(self, url: str, admin_key: Optional[str], timeout_s: float = 10.0) -> None:
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    def replica_urls(self) -> list[str]:
        r = self._client.get("/admin/replicas")
        r.raise_for_status()
        return [replica["url"] for replica in r.json()["replicas"]]

    def add(self, replica_url: str) -> None:
        self._client.post("/admin/replicas", json={"url": replica_url}).raise_for_status()

    def remove(self, replica_url: str) -> None:
        r = self._client.request("DELETE", "/admin/replicas", json={"url": replica_url})
        if r.status_code != 404:  # 404: not registered (any more): nothing to remove
            r.raise_for_status()

    def close(self) -> None:
        self._client.close()
