"""The shared-storage check at trainer start: token files in --output-dir and a --data fingerprint name the
node that does not share them (here two "nodes" are two folders, as a private mount would make them)."""

from __future__ import annotations

import shutil

from sdzero.cluster.shared_storage import NodeReport, listing_fingerprint, unseen_tokens, verdict, write_token
from sdzero.models.tiny import write_synthetic_dataset


def reports_for(out_of: dict[str, object], data_of: dict[str, object]) -> list[NodeReport]:
    """Each host writes its token into its view of the output folder, then reads the others' (as the
    check does between its two barriers)."""
    hosts = list(out_of)
    for host in hosts:
        write_token(out_of[host], host)
    return [
        NodeReport(
            host,
            rank,
            listing_fingerprint(data_of[host]),
            unseen_tokens(out_of[host], [h for h in hosts if h != host]),
        )
        for rank, host in enumerate(hosts)
    ]


def test_shared_folders_pass(tmp_path):
    data = write_synthetic_dataset(tmp_path / "data", images=4, size=16)
    shared = tmp_path / "out" / "tokens"
    reports = reports_for(
        {"node-a": shared, "node-b": shared, "node-c": shared},
        dict.fromkeys(["node-a", "node-b", "node-c"], data),
    )
    assert verdict(reports, tmp_path / "out", data) is None


def test_a_node_with_a_private_output_folder_is_named(tmp_path):
    data = write_synthetic_dataset(tmp_path / "data", images=4, size=16)
    shared, private = tmp_path / "out" / "tokens", tmp_path / "private" / "tokens"
    reports = reports_for(
        {"node-a": shared, "node-b": private, "node-c": shared},
        dict.fromkeys(["node-a", "node-b", "node-c"], data),
    )
    message = verdict(reports, tmp_path / "out", data)
    assert message and message.startswith(
        f"--output-dir {tmp_path / 'out'}: node node-b does not share it with node node-a"
    )


def test_a_node_missing_images_is_named(tmp_path):
    data = write_synthetic_dataset(tmp_path / "data", images=4, size=16)
    stale = tmp_path / "stale"
    shutil.copytree(data, stale)
    next(stale.glob("*.png")).unlink()  # one image never synced to this node
    shared = tmp_path / "out" / "tokens"
    reports = reports_for({"node-a": shared, "node-b": shared}, {"node-a": data, "node-b": stale})
    message = verdict(reports, tmp_path / "out", data)
    assert message and message.startswith(f"--data {data}: node node-b sees different files or metadata")


def test_fingerprint_follows_metadata_bytes_and_listing_not_timestamps(tmp_path):
    data = write_synthetic_dataset(tmp_path / "data", images=4, size=16)
    copy = tmp_path / "copy"
    shutil.copytree(data, copy, copy_function=shutil.copy)  # new mtimes, same contents
    assert listing_fingerprint(copy) == listing_fingerprint(data)
    meta = copy / "metadata.jsonl"
    meta.write_text(meta.read_text().replace("a ", "A ", 1))  # same size, one caption changed
    assert listing_fingerprint(copy) != listing_fingerprint(data)


def test_torn_or_foreign_token_is_not_counted_as_seen(tmp_path):
    folder = tmp_path / "tokens"
    write_token(folder, "node-a")
    (folder / "node-b.token").write_text("")  # a half-written token (no atomic rename)
    assert unseen_tokens(folder, ["node-a", "node-b", "node-c"]) == ("node-b", "node-c")
