"""A data: URI's declared type must fit its modality in the service as in records: a PNG
declared text/plain or audio/wav, a WAV declared image/png, is a 422 naming what was declared;
the client's own URIs, other image and audio types and untyped URIs are read."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.client import Client
from tests.app.conftest import build_index, running, settings_for
from tests.app.test_hostile import GOOD, media_model, png, wav
from tests.models.test_inputs import data_uri

WRONG = [
    ("image", "text/plain", png(1)),
    ("image", "audio/wav", png(1)),
    ("audio", "image/png", wav(300)),
    ("audio", "text/plain", wav(300)),
]
READ = [
    ("image", "image/jpeg", png(1)),  # the decoder reads what the bytes are
    ("image", "", png(1)),
    ("image", "application/octet-stream", png(1)),
    ("audio", "audio/x-wav", wav(300)),
    ("audio", "audio/wave", wav(300)),
    ("audio", "", wav(300)),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("types")
    rows = [
        {"id": f"g{i}", "image": GOOD["image"](i), "audio": GOOD["audio"](i), "vec": [i, 1, 2]}
        for i in range(12)
    ]
    build_index(tmp / "root", media_model(tmp, {"image", "audio", "vec"}), rows, tmp)
    return tmp / "root"


def test_a_medium_declared_as_another_type_is_refused(root: Path) -> None:
    with running(settings_for(root)) as http:
        for modality, mime, raw in WRONG:
            uri = data_uri(mime, raw)
            for path, body in (
                ("/v1/embed", {"modality": modality, "inputs": [uri]}),
                ("/v1/search", {"query": {modality: uri}, "k": 3}),
            ):
                r = http.post(path, json=body)
                assert r.status_code == 422, (path, mime, r.text)
                assert r.json()["error_type"] == "invalid_input"
                assert f"declares the type '{mime}', not {modality}/*" in r.json()["error"]


def test_other_types_untyped_uris_and_the_client_are_read(root: Path) -> None:
    with running(settings_for(root)) as http:
        for modality, mime, raw in READ:
            r = http.post("/v1/embed", json={"modality": modality, "inputs": [data_uri(mime, raw)]})
            assert r.status_code == 200, (mime, r.text)
        with Client(str(http.base_url)) as client:
            assert client.embed("image", [png(2)]).shape == (1, 4)
            assert client.embed("audio", [wav(400)]).shape == (1, 4)
            assert len(client.search({"image": png(3)}, k=3).hits) == 3
