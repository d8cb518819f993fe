"""Object-storage transport (issue 8): publish and receive through a local
folder (file://) and a real S3 API on loopback (moto's server), including an
interrupted upload, a publisher that loses the race for a version, a
corrupted object, a receiver that starts mid-stream, catch-up through the
chain, and GC."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import dcr
from dcr import _core
from dcr.cli import main
from conftest import write_bf16

SHAPES = {
    "model.embed_tokens.weight": (256, 64),
    "model.layers.0.mlp.up_proj.weight": (176, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.norm.weight": (64,),
}
SMALL_CHUNKS = 16 << 10  # many chunk objects per version


def chain(tmp: Path, n: int, seed: int = 7) -> list[Path]:
    """Versions 0..n of a small bf16 checkpoint, ~3 % of elements moving per step."""
    from dcr._st import f32_to_bf16_bits

    rng = np.random.default_rng(seed)
    cur = {k: f32_to_bf16_bits(rng.normal(0, 0.02, size=s).astype(np.float32)) for k, s in SHAPES.items()}
    out = []
    for v in range(n + 1):
        if v:
            for k, a in cur.items():
                a = a.copy()
                mask = rng.random(a.shape) < 0.03
                a[mask] = (a[mask].astype(np.int32) + rng.choice([-2, -1, 1, 2], size=int(mask.sum()))).astype(np.uint16)
                cur[k] = a
        out.append(write_bf16(tmp / f"v{v}.safetensors", cur))
    return out


def deltas(paths: list[Path], tmp: Path) -> list[Path]:
    out = []
    for i in range(1, len(paths)):
        d = tmp / f"{i - 1}-{i}.dcr"
        dcr.diff_files(paths[i - 1], paths[i], d, chunk_bytes=SMALL_CHUNKS, base_version=i - 1, target_version=i)
        out.append(d)
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst


# ------------------------------------------------------------------ stores


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ALLOW_HTTP": "true",
        }.items():
            mp.setenv(k, v)
        mp.delenv("AWS_SESSION_TOKEN", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        yield endpoint
    server.stop()


class Backend:
    """A fresh bucket/prefix, plus raw access for tampering."""

    def __init__(self, kind: str, url: str, tmp: Path, s3=None, bucket: str = "", prefix: str = ""):
        self.kind, self.url, self.tmp, self.s3, self.bucket, self.prefix = kind, url, tmp, s3, bucket, prefix

    def keys(self, sub: str) -> list[str]:
        if self.kind == "file":
            root = self.tmp / "store"
            return sorted(str(p.relative_to(root)) for p in (root / sub).rglob("*") if p.is_file())
        resp = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}/{sub}")
        return sorted(o["Key"][len(self.prefix) + 1 :] for o in resp.get("Contents", []))

    def read(self, key: str) -> bytes:
        if self.kind == "file":
            return (self.tmp / "store" / key).read_bytes()
        return self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()

    def write(self, key: str, data: bytes) -> None:
        if self.kind == "file":
            (self.tmp / "store" / key).write_bytes(data)
        else:
            self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path: Path) -> Backend:
    if request.param == "file":
        return Backend("file", (tmp_path / "store").as_uri(), tmp_path)
    endpoint = request.getfixturevalue("s3_endpoint")
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    bucket = f"dcr-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    return Backend("s3", f"s3://{bucket}/runs/exp1", tmp_path, s3, bucket, "runs/exp1")


# ------------------------------------------------------------------ tests


def test_cli_publish_then_receive_is_bit_exact(store: Backend, tmp_path: Path, capsys):
    paths = chain(tmp_path, 1)
    (d,) = deltas(paths, tmp_path)
    assert main(["publish", str(d), "--to", store.url]) == 0
    assert "committed v1" in capsys.readouterr().out
    target = copy(paths[0], tmp_path / "replica.safetensors")
    assert main(["receive", str(target), "--from", store.url, "--receiver-id", "r0"]) == 0
    assert "now at v1" in capsys.readouterr().out
    assert target.read_bytes() == paths[1].read_bytes()
    # Applied through the receiver journal, which records the version.
    st = dcr.receiver_status(target)
    assert st["committed"]["version"] == 1 and st["refit"] is None and st["spool_bytes"] is None, st
    # At the newest: exit 0, nothing done.
    assert main(["receive", str(target), "--from", store.url]) == 0
    assert "nothing to do" in capsys.readouterr().out
    # Streaming without the journal is a relay option only: refused, with the reason.
    assert main(["receive", str(target), "--from", store.url, "--no-journal"]) != 0
    assert "--no-journal" in capsys.readouterr().err
    keys = store.keys("")
    assert "v1/manifest.json" in keys and "acks/v1/r0" in keys and "receivers/r0" in keys
    objs = [k for k in keys if k.startswith("v1/objects/")]
    assert len(objs) > 2, "header and chunk frames are separate objects"
    assert main(["versions", store.url, "--json"]) == 0


def test_interrupted_upload_is_invisible(store: Backend, tmp_path: Path):
    paths = chain(tmp_path, 1)
    (d,) = deltas(paths, tmp_path)
    info = _core.objstore_publish(d, store.url, commit=False)
    assert info["committed"] is False and info["objects"] > 1
    assert any(k.startswith("v1/objects/") for k in store.keys("v1"))
    assert _core.objstore_versions(store.url) == []
    target = copy(paths[0], tmp_path / "replica.safetensors")
    r = _core.objstore_receive(target, store.url)
    assert r["applied"] == [] and r["version"] is None
    assert target.read_bytes() == paths[0].read_bytes()
    # The same version can still be committed later.
    _core.objstore_publish(d, store.url)
    assert _core.objstore_receive(target, store.url)["applied"] == [1]
    assert target.read_bytes() == paths[1].read_bytes()


def test_second_publisher_racing_for_a_version_is_refused(store: Backend, tmp_path: Path):
    paths = chain(tmp_path, 2)
    d01, _ = deltas(paths, tmp_path)
    # Another delta from the same base, racing for the same version number.
    rival = tmp_path / "rival.dcr"
    dcr.diff_files(paths[0], paths[2], rival, chunk_bytes=SMALL_CHUNKS)
    won: list[dict] = []

    def progress(done: int, total: int) -> None:
        # The rival has chosen v1 and is uploading; the winner commits v1 now.
        if not won:
            won.append(_core.objstore_publish(d01, store.url))

    with pytest.raises(_core.VersionExistsError, match="version 1 is already committed") as e:
        _core.objstore_publish(rival, store.url, progress=progress)
    assert isinstance(e.value, dcr.DcrError)
    assert won and won[0]["version"] == 1
    (m,) = _core.objstore_versions(store.url)
    assert m["delta_id"] == won[0]["delta_id"], "the winner's manifest is untouched"
    # Asking for a committed version up front: refused before any upload.
    with pytest.raises(_core.VersionExistsError):
        _core.objstore_publish(rival, store.url, version=1)
    # The CLI says so in one line and exits 2.
    assert main(["publish", str(rival), "--to", store.url, "--version", "1", "-q"]) == 2


def test_corrupted_object_is_refused_and_target_untouched(store: Backend, tmp_path: Path):
    paths = chain(tmp_path, 1)
    (d,) = deltas(paths, tmp_path)
    _core.objstore_publish(d, store.url)
    key = [k for k in store.keys("v1/objects") if len(store.read(k)) > 100][0]
    good = store.read(key)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x10
    store.write(key, bytes(bad))
    target = copy(paths[0], tmp_path / "replica.safetensors")
    with pytest.raises(dcr.CorruptDeltaError, match="checksum mismatch") as e:
        _core.objstore_receive(target, store.url)
    assert key.split("/")[-1] in str(e.value), "the message names the object"
    assert target.read_bytes() == paths[0].read_bytes()
    # Repaired upstream (e.g. republished): the next receive succeeds.
    store.write(key, good)
    assert _core.objstore_receive(target, store.url)["applied"] == [1]
    assert target.read_bytes() == paths[1].read_bytes()


def test_receiver_started_mid_stream(store: Backend, tmp_path: Path):
    paths = chain(tmp_path, 1)
    target = copy(paths[0], tmp_path / "replica.safetensors")
    # The publisher is mid-stream: objects and index are up, no manifest yet.
    _core.objstore_publish_diff(paths[0], paths[1], store.url, chunk_bytes=SMALL_CHUNKS, commit=False)
    result: dict = {}
    events: list[str] = []

    def run() -> None:
        try:
            result.update(_core.objstore_receive(target, store.url, wait=60.0, poll=0.05,
                                                  progress=lambda e, *_: events.append(e)))
        except Exception as e:  # surfaced below
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while "prefetched" not in events and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "waiting" in events and "prefetched" in events, events
    # The publisher finishes: the same frames, then the manifest.
    _core.objstore_publish_diff(paths[0], paths[1], store.url, chunk_bytes=SMALL_CHUNKS, version=1)
    t.join(timeout=120)
    assert not t.is_alive()
    assert "error" not in result, result.get("error")
    assert result["applied"] == [1]
    assert result["prefetched"] > 0, "objects were fetched before the manifest existed"
    assert target.read_bytes() == paths[1].read_bytes()


def test_receiver_several_versions_behind_catches_up_and_gc(store: Backend, tmp_path: Path):
    paths = chain(tmp_path, 5)
    ds = deltas(paths, tmp_path)
    slow = copy(paths[0], tmp_path / "slow.safetensors")
    assert _core.objstore_publish(ds[0], store.url)["version"] == 1
    assert _core.objstore_receive(slow, store.url, receiver_id="slow")["applied"] == [1]
    for i, d in enumerate(ds[1:4], start=2):
        assert _core.objstore_publish(d, store.url)["version"] == i
    assert [v["version"] for v in _core.objstore_versions(store.url)] == [1, 2, 3, 4]
    mid = copy(paths[2], tmp_path / "mid.safetensors")
    assert _core.objstore_receive(mid, store.url, receiver_id="mid")["applied"] == [3, 4]
    # GC keeps what the slow receiver (acknowledged v1) still needs.
    assert _core.objstore_gc(store.url, dry_run=True)["deleted"] == [1]
    assert len(_core.objstore_versions(store.url)) == 4, "a dry run deletes nothing"
    assert main(["gc", store.url, "--dry-run", "-q"]) == 0
    g = _core.objstore_gc(store.url)
    assert g["receivers"] == {"slow": 1, "mid": 4} and g["deleted"] == [1]
    # Three versions behind: the CLI applies the rest of the chain in order.
    assert main(["receive", str(slow), "--from", store.url, "--receiver-id", "slow", "-q"]) == 0
    assert slow.read_bytes() == paths[4].read_bytes() == mid.read_bytes()
    g = _core.objstore_gc(store.url)
    assert g["acknowledged_by_all"] == 4 and g["deleted"] == [2, 3]
    assert [v["version"] for v in _core.objstore_versions(store.url)] == [4], "the newest stays"
    assert not store.keys("v1") and not store.keys("v2") and not store.keys("streaming/v3")
    # A receiver that missed the deleted versions gets a clear error.
    with pytest.raises(_core.VersionChainError, match="garbage-collected"):
        _core.objstore_receive(copy(paths[0], tmp_path / "late.safetensors"), store.url)
    # The next version publishes and applies on top of the newest.
    assert _core.objstore_publish(ds[4], store.url)["version"] == 5
    assert _core.objstore_receive(slow, store.url, receiver_id="slow")["applied"] == [5]
    assert slow.read_bytes() == paths[5].read_bytes()


def test_target_not_in_the_chain_is_refused(store: Backend, tmp_path: Path):
    paths = chain(tmp_path, 1)
    (d,) = deltas(paths, tmp_path)
    _core.objstore_publish(d, store.url)
    (tmp_path / "other").mkdir()
    stranger = chain(tmp_path / "other", 0, seed=99)[0]
    with pytest.raises(_core.VersionChainError, match="dense refit"):
        _core.objstore_receive(stranger, store.url)
    assert issubclass(_core.VersionChainError, dcr.BaseMismatchError)


def test_unknown_url_schemes_get_a_clear_error(tmp_path: Path, capsys):
    d = tmp_path / "d.dcr"
    d.write_bytes(b"")
    assert main(["publish", str(d), "--to", "ftp://example/x"]) == 2
    err = capsys.readouterr().err
    assert "not an object-store URL" in err and "relay address" in err
    assert main(["receive", str(d), "--from", "ftp://example/x"]) == 2
    with pytest.raises(ValueError, match="scheme"):
        _core.objstore_versions("ftp://example/x")


def test_missing_bucket_is_an_object_store_error(s3_endpoint: str, tmp_path: Path):
    paths = chain(tmp_path, 0)
    with pytest.raises(_core.ObjectStoreError, match="check the URL, the credentials") as e:
        _core.objstore_receive(paths[0], "s3://no-such-bucket-dcr/x")
    assert isinstance(e.value, dcr.DcrError)
    assert issubclass(_core.VersionExistsError, _core.ObjectStoreError)
