"""HCLIP_ENCODER_RUNTIME=onnx | onnx-int8 on tiny random towers made by `transformers`' config
classes (one block each, so that their exports stay quick): fp32 embeddings equal torch's within
1e-4, int8 ones stay close, a graph is exported once and again when its tower's files change,
a missing onnxruntime stops `hclip serve` in one line, and a served raw text query gets torch's
results, with ONNX Runtime's telemetry off."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from models.checkpoint import load_model, save_model
from models.config import ModalityConfig, ModelConfig
from models.encoders import decode
from models.encoders import onnx_runtime as rt
from models.encoders.runtime import Runtime
from models.encoders.towers import load_processor
from models.extras import ExtraMissing, load_onnxruntime
from models.model import MultimodalModel
from tests.app.conftest import free_port, running, settings_for
from tests.app.test_readiness import stop, wait_ready
from tests.conftest import index_build, write_jsonl
from tests.models.test_inputs import data_uri
from tests.models.test_pretrained_towers import WORDS, png, records, wav

try:
    load_onnxruntime("these tests")  # as the service loads it: its telemetry off
except ExtraMissing:
    pytest.skip("the 'onnx' extra is not installed", allow_module_level=True)
REPO = Path(__file__).resolve().parents[2]


def tiny_towers(d: Path) -> dict[str, Path]:
    """A BERT, a ViT and a wav2vec 2.0 of one block each, with their processors."""
    import transformers as tf

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "number", *WORDS]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
             "intermediate_size": 37}  # fmt: skip
    torch.manual_seed(0)
    tf.BertModel(tf.BertConfig(vocab_size=len(vocab), max_position_embeddings=64, **small)
                 ).save_pretrained(d / "bert")  # fmt: skip
    tf.BertTokenizer(vocab_file=str(d / "vocab.txt")).save_pretrained(d / "bert")
    tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=8, **small)).save_pretrained(d / "vit")
    tf.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(d / "vit")
    w2v = tf.Wav2Vec2Config(conv_dim=(16,), conv_stride=(5,), conv_kernel=(10,),
                            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
                            vocab_size=10, **small)  # fmt: skip
    tf.Wav2Vec2Model(w2v).save_pretrained(d / "w2v")
    tf.Wav2Vec2FeatureExtractor(sampling_rate=16000, return_attention_mask=True).save_pretrained(
        d / "w2v"
    )
    return {name: d / name for name in ("bert", "vit", "w2v")}


def model_config(towers: dict[str, Path]) -> ModelConfig:
    modalities = {
        "photo": {"kind": "transformers", "model": str(towers["vit"]), "input": "image"},
        "sound": {"kind": "transformers", "model": str(towers["w2v"]), "input": "audio",
                  "max_seconds": 0.5},
        "caption": {"kind": "transformers", "model": str(towers["bert"]), "input": "text",
                    "pooling": "mean"},
    }  # fmt: skip
    return ModelConfig.from_dict({"modalities": modalities, "head": "hclip", "latent_dim": 8})


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, Path]:
    """(model directory, index root): a seeded model over the tiny towers, indexed by torch."""
    tmp = tmp_path_factory.mktemp("onnx")
    (tmp / "towers").mkdir()
    cfg = model_config(tiny_towers(tmp / "towers"))
    torch.manual_seed(0)
    model_dir = save_model(MultimodalModel(cfg), tmp / "model")
    write_jsonl(tmp / "records.jsonl", records(24))
    assert index_build(model_dir, tmp / "records.jsonl", tmp / "root") == 0
    return model_dir, tmp / "root"


def queries(cfg: ModelConfig) -> dict[str, list]:
    """Per modality, decoded queries of several shapes: texts and clips of unequal length."""
    raw = {
        "photo": [data_uri("image/png", png(i)) for i in range(3)],
        "sound": [data_uri("audio/wav", wav(f, seconds=s)) for f, s in ((300, 0.2), (500, 0.45),
                                                                        (700, 0.45))],
        "caption": ["the number two", "zero", "the number nine eight seven six five four"],
    }  # fmt: skip
    return {m: [decode(v, cfg.modalities[m]) for v in values] for m, values in raw.items()}


@pytest.fixture(scope="module")
def embeddings(served) -> dict[str, dict[str, torch.Tensor]]:
    """Per runtime and modality, the queries' embeddings, a batch and each alone."""
    model_dir = served[0]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in ("torch", "onnx", "onnx-int8"):
        model = load_model(model_dir).to_inference("cpu", runtime=Runtime(name, model_dir / "onnx"))
        items = queries(model.cfg)
        with torch.no_grad():
            out[name] = {m: model.encode(m, xs) for m, xs in items.items()}
            out[name + "/alone"] = {
                m: torch.cat([model.encode(m, [x]) for x in xs]) for m, xs in items.items()
            }
    return out


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


@pytest.mark.parametrize("modality", ["photo", "sound", "caption"])
def test_onnx_fp32_embeddings_equal_torch_s(embeddings, modality) -> None:
    for how in ("", "/alone"):
        want, got = embeddings["torch" + how][modality], embeddings["onnx" + how][modality]
        assert not torch.equal(want[0], want[1])  # distinct queries, not one repeated
        assert (got - want).abs().max() < 1e-4, (how, (got - want).abs().max())
        assert cosines(got, want).min() >= 0.9999


@pytest.mark.parametrize("modality", ["photo", "sound", "caption"])
def test_onnx_int8_embeddings_stay_close_to_torch_s(embeddings, modality) -> None:
    """Dynamic int8 changes the numbers (it is no copy of fp32) but keeps their direction; tiny
    random towers are a hard case for it (measured: cosine 0.9966 at worst, the audio tower)."""
    want, got = embeddings["torch"][modality], embeddings["onnx-int8"][modality]
    assert (got - want).abs().max() > 1e-4
    assert cosines(got, want).min() > 0.99, cosines(got, want)


def test_the_text_kind_runs_its_sentence_encoder_under_the_runtime(served, monkeypatch) -> None:
    """The `text` kind's MiniLM is a `transformers` tower too (the tiny BERT stands in for it):
    placed under onnx, its sentence embeddings are torch's."""
    from models.encoders import minilm, text

    bert = load_model(served[0]).cfg.modalities["caption"]
    monkeypatch.setattr(minilm, "backbone_config", lambda: bert)
    monkeypatch.setattr(text, "backbone_config", lambda: bert)
    monkeypatch.setattr(minilm, "_shared", {})
    monkeypatch.setattr(minilm, "BACKBONE_DIM", 32)
    monkeypatch.setattr(text, "BACKBONE_DIM", 32)
    enc = text.TextEncoder(ModalityConfig.from_dict({"kind": "text"}, "m"), 8)
    sentences = ["the number two", "the number nine eight seven six five four"]
    want = enc.encode(sentences)
    runtime = Runtime("onnx", served[0] / "onnx")
    enc.place(torch.device("cpu"), None, runtime)
    got = enc.encode(sentences)
    assert isinstance(minilm.shared_backbone(runtime)._run, rt.OnnxTower)
    assert (got - want).abs().max() < 1e-4


def test_a_graph_is_exported_once_and_again_when_its_tower_changes(
    served, embeddings, monkeypatch, tmp_path
) -> None:
    model_dir = served[0]
    graphs = sorted(p.name for p in (model_dir / "onnx").iterdir() if p.is_dir())
    assert len(graphs) == 6, graphs  # three towers, fp32 and int8, no temporary left
    mtimes = {p: p.stat().st_mtime_ns for p in (model_dir / "onnx").rglob("*.onnx")}
    exports: list[str] = []
    real_export = rt.export_graph
    monkeypatch.setattr(rt, "export_graph", lambda cfg, dest: exports.append(str(cfg.model)))
    monkeypatch.setattr(rt, "_SESSIONS", {})  # a process of its own
    load_model(model_dir).to_inference("cpu", runtime=Runtime("onnx", model_dir / "onnx"))
    assert exports == []
    assert mtimes == {p: p.stat().st_mtime_ns for p in (model_dir / "onnx").rglob("*.onnx")}

    # a copy of the ViT (the same tower: its graph is found), whose weights then change where
    # they lie: its graph is exported anew, under a new key
    from transformers import ViTModel

    photo = load_model(model_dir).cfg.modalities["photo"]
    shutil.copytree(str(photo.model), tmp_path / "vit")
    vit_cfg = ModalityConfig.from_dict(photo.to_dict() | {"model": str(tmp_path / "vit")}, "m")
    runtime = Runtime("onnx", model_dir / "onnx")
    assert rt.graph_dir(vit_cfg, runtime).name in graphs
    rt.load_onnx_tower(vit_cfg, runtime)
    assert exports == []
    vit = ViTModel.from_pretrained(tmp_path / "vit")
    with torch.no_grad():
        vit.pooler.dense.weight.mul_(-1.0)
    vit.save_pretrained(tmp_path / "vit")
    monkeypatch.setattr(rt, "export_graph", real_export)
    new = rt.load_onnx_tower(vit_cfg, runtime)
    assert rt.graph_dir(vit_cfg, runtime).name not in graphs
    image = [decode(data_uri("image/png", png(5)), vit_cfg)]
    torch_now = rt.load_tower(vit_cfg)(image)  # the torch path reads the files again too
    assert (new(image) - torch_now).abs().max() < 1e-4


def test_a_call_granted_every_core_runs_in_a_session_of_every_core(served) -> None:
    """The service grants an encode call its threads through torch.set_num_threads (a lone
    query: every core); an ONNX session's count is fixed, so such a call runs in a second
    session made with every core's thread (made with the tower, so the first lone query does
    not wait for it), and gives the same embeddings."""
    model_dir = served[0]
    model_cfg = load_model(model_dir).cfg
    cfg = model_cfg.modalities["photo"]
    tower = rt.OnnxTower(
        load_processor(cfg), rt.ensure_graph(cfg, Runtime("onnx", model_dir / "onnx")), 1, 2
    )
    images = queries(model_cfg)["photo"]
    made = dict(tower._sessions)
    assert sorted(made) == [1, 2]  # both before any call
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        share = tower(images)
        torch.set_num_threads(2)
        every = tower(images)
    finally:
        torch.set_num_threads(before)
    threads = {
        n: int(s.get_session_options().intra_op_num_threads) for n, s in tower._sessions.items()
    }
    assert threads == {1: 1, 2: 2}
    assert all(tower._sessions[n] is made[n] for n in made)  # no call made another
    assert (every - share).abs().max() < 1e-5


def test_a_missing_onnxruntime_is_one_line_at_start(served, tmp_path) -> None:
    """`hclip serve` where `import onnxruntime` fails: exit 2 and one line naming the setting
    and the extra, before anything loads."""
    block = (
        "import sys\n"
        "class NoOnnx:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'onnxruntime': raise ImportError(name)\n"
        "sys.meta_path.insert(0, NoOnnx())\n"
        "from app.cli import run\n"
        "run()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "HCLIP_ENCODER_RUNTIME": "onnx"}
    done = subprocess.run(
        [sys.executable, "-c", block, "serve", "--root", str(served[1]), "--workers", "1",
         "--port", str(free_port())],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("hclip serve: error: HCLIP_ENCODER_RUNTIME=onnx needs onnxruntime")
    assert "pip install 'hclip[onnx]'" in lines[0]


def test_hclip_serve_with_onnx_answers_a_raw_text_query_as_torch_does(served, tmp_path) -> None:
    """The server under onnx answers as torch does and writes nothing in its user's home:
    ONNX Runtime 1.29 and later, left to themselves, keep a device id and an event store in
    the user's cache directory and upload usage events to Microsoft."""
    root = served[1]
    body = {"query": {"caption": "the number three"}, "k": 10}
    with running(settings_for(root)) as client:  # the torch runtime, in this process
        want = client.post("/v1/search", json=body).json()["results"]
    port = free_port()
    home, cache = tmp_path / "home", tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HCLIP_ENCODER_RUNTIME": "onnx",
           "HOME": str(home), "XDG_CACHE_HOME": str(cache)}  # fmt: skip
    env.pop("HCLIP_REDIS_URL", None)
    env.pop("ORT_DISABLE_TELEMETRY", None)  # this process set it: the server must, itself
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--root", str(root), "--workers", "1",
         "--port", str(port)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        got = httpx.post(url + "/v1/search", json=body, timeout=30).json()["results"]
    finally:
        stop(proc)
    assert [r["id"] for r in got] == [r["id"] for r in want]
    assert np.allclose([r["score"] for r in got], [r["score"] for r in want], atol=1e-4)
    # nothing of the server's in the user's home or cache: ONNX Runtime's store would be
    # <cache>/Microsoft/DeveloperTools/.onnxruntime
    kept = [p for d in (home, cache) if d.exists() for p in [d, *d.rglob("*")]]
    assert not kept, kept


def test_a_tower_the_exporter_cannot_take_is_a_pretrained_error(
    served, tmp_path, monkeypatch
) -> None:
    """The version is then refused with a reason (a ValueError), not a worker's crash, and
    nothing half-written stays in the cache."""
    from models.errors import PretrainedError

    def refuse(*args, **kwargs):
        raise RuntimeError("unsupported operator aten::foo\nmore detail")

    monkeypatch.setattr(torch.onnx, "export", refuse)
    bert = load_model(served[0]).cfg.modalities["caption"]
    with pytest.raises(PretrainedError, match=r"aten::foo.*HCLIP_ENCODER_RUNTIME=torch"):
        rt.load_onnx_tower(bert, Runtime("onnx", tmp_path / "onnx"))
    assert [p.suffix for p in (tmp_path / "onnx").iterdir()] == [".lock"]
