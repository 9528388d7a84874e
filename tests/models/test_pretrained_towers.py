"""Pretrained towers from `transformers`, by config: tiny random-initialised models made with the
library's config classes and saved with save_pretrained (a CLIP vision model, a ViT, a wav2vec
2.0 and a BERT), loaded by path; a three-modality H-CLIP trained on them frozen and with the
last block trainable; the feature cache; indexing and serving with scores that the stored
embeddings recompute; and the errors a user meets."""

from __future__ import annotations

import io
import json
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from models.config import ConfigError, ModalityConfig
from models.encoders import build_encoder, decode, tower_inputs
from models.encoders import pretrained as pretrained_module
from models.encoders import towers as tower_module
from models.errors import PretrainedError
from models.limits import InputError
from tests.app.conftest import running, settings_for
from tests.conftest import index_build, run_cli
from tests.models.test_inputs import data_uri

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def make_towers(d: Path) -> dict[str, Path]:
    import transformers as tf

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "number", *WORDS]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 37}  # fmt: skip
    torch.manual_seed(0)
    out = {}
    bert = tf.BertModel(tf.BertConfig(vocab_size=len(vocab), max_position_embeddings=64, **small))
    bert.save_pretrained(d / "bert")
    tf.BertTokenizer(vocab_file=str(d / "vocab.txt")).save_pretrained(d / "bert")
    vit = tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=8, **small))
    vit.save_pretrained(d / "vit")
    tf.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(d / "vit")
    clip = tf.CLIPVisionModel(tf.CLIPVisionConfig(image_size=32, patch_size=8, **small))
    clip.save_pretrained(d / "clip")
    tf.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(d / "clip")
    w2v = tf.Wav2Vec2Model(
        tf.Wav2Vec2Config(
            conv_dim=(16, 16),
            conv_stride=(5, 5),
            conv_kernel=(10, 10),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            vocab_size=10,
            **small,
        )
    )
    w2v.save_pretrained(d / "w2v")
    tf.Wav2Vec2FeatureExtractor(sampling_rate=16000, return_attention_mask=True).save_pretrained(
        d / "w2v"
    )
    # a two-tower checkpoint, as CLIP is published: CLIPModel with its image processor and a
    # tokenizer (BERT's word pieces stand in for CLIP's BPE; [SEP] ends a sentence)
    full = tf.CLIPModel(tf.CLIPConfig(
        text_config={**small, "vocab_size": len(vocab), "max_position_embeddings": 64,
                     "eos_token_id": vocab.index("[SEP]")},
        vision_config={**small, "image_size": 32, "patch_size": 8}, projection_dim=16))  # fmt: skip
    full.save_pretrained(d / "clip-full")
    tf.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(d / "clip-full")
    tf.BertTokenizer(vocab_file=str(d / "vocab.txt")).save_pretrained(d / "clip-full")
    for name in ("bert", "vit", "clip", "w2v", "clip-full"):
        out[name] = d / name
    return out


@pytest.fixture(scope="module")
def towers(tmp_path_factory) -> dict[str, Path]:
    return make_towers(tmp_path_factory.mktemp("towers"))


def png(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (24, 30, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def wav(freq: float, rate: int = 22050, seconds: float = 0.3) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    x = (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(x.tobytes())
    return buf.getvalue()


def records(n: int) -> list[dict]:
    return [
        {
            "id": f"r{i}",
            "photo": data_uri("image/png", png(i)),
            "sound": data_uri("audio/wav", wav(200 + 25 * i)),
            "caption": f"the number {WORDS[i % 10]} {i}",
            "payload": {"i": i},
        }
        for i in range(n)
    ]


def write_config(d: Path, towers: dict[str, Path], image: str = "vit", layers: int = 0) -> Path:
    recs = d / "records.jsonl"
    recs.write_text("".join(json.dumps(r) + "\n" for r in records(24)))
    modalities = {
        "photo": {"kind": "transformers", "model": str(towers[image]), "input": "image",
                  "train_layers": layers},
        "sound": {"kind": "transformers", "model": str(towers["w2v"]), "input": "audio",
                  "max_seconds": 0.5},
        "caption": {"kind": "transformers", "model": str(towers["bert"]), "input": "text",
                    "pooling": "mean"},
    }  # fmt: skip
    cfg = {"modalities": modalities, "head": "hclip", "latent_dim": 8,
           "train": {"records": "records.jsonl", "epochs": 2, "batch_size": 8, "lr": 0.01,
                     "num_workers": 0}}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    return d / "config.json"


@pytest.fixture
def tower_calls(monkeypatch) -> list[int]:
    """Inputs that went through a frozen tower (not through its cache)."""
    calls: list[int] = []
    original = pretrained_module.PretrainedFeatures.__call__

    def counted(self, items):
        calls.append(len(items))
        return original(self, items)

    monkeypatch.setattr(pretrained_module.PretrainedFeatures, "__call__", counted)
    return calls


INPUTS = {
    "clip": ("image", data_uri("image/png", png(1))),
    "vit": ("image", data_uri("image/png", png(2))),
    "w2v": ("audio", data_uri("audio/wav", wav(300))),
    "bert": ("text", "the number two"),
    "clip-full/image": ("image", data_uri("image/png", png(3))),
    "clip-full/text": ("text", "the number four"),
}


@pytest.mark.parametrize("name", list(INPUTS))
def test_each_tower_loads_by_path_and_encodes_to_unit_vectors(towers, name) -> None:
    kind, raw = INPUTS[name]
    model = str(towers[name.split("/")[0]])
    cfg = ModalityConfig.from_dict({"kind": "transformers", "model": model, "input": kind},
                                   "modalities.m")  # fmt: skip
    enc = build_encoder(cfg, 8)
    out = enc.encode([decode(raw, cfg), decode(raw, cfg)])
    assert out.shape == (2, 8) and torch.allclose(out.norm(dim=-1), torch.ones(2), atol=1e-5)
    assert torch.allclose(out[0], out[1])


def test_loading_a_tower_draws_nothing_from_the_seeded_rng(towers) -> None:
    """A seeded run's maps start the same whether or not the process loaded its towers before
    (wav2vec 2.0's constructor draws a random vector that loading then overwrites)."""
    cfg = ModalityConfig.from_dict({"kind": "transformers", "model": str(towers["w2v"]),
                                    "input": "audio"}, "m")  # fmt: skip
    tower_module._LOADED.clear()
    torch.manual_seed(0)
    tower_module.load_tower(cfg)
    after_a_load = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after_a_load, torch.rand(4))


@pytest.mark.parametrize("kind", ["image", "text"])
def test_a_two_tower_checkpoint_runs_the_tower_of_its_input(towers, kind) -> None:
    """A published CLIP checkpoint (CLIPModel: both towers) as an image or a text modality: its
    projected embeddings for that input, and fine-tuning touches only that input's tower."""
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    path = towers["clip-full"]
    cfg = ModalityConfig.from_dict({"kind": "transformers", "model": str(path), "input": kind},
                                   "m")  # fmt: skip
    enc = build_encoder(cfg, 8)
    raw = INPUTS[f"clip-full/{kind}"][1]
    feats = enc.collate([decode(raw, cfg)])
    clip = CLIPModel.from_pretrained(path).eval()
    with torch.no_grad():
        if kind == "image":
            from PIL import Image

            image = Image.open(io.BytesIO(png(3))).convert("RGB")
            pixels = AutoImageProcessor.from_pretrained(path)(images=[image], return_tensors="pt")
            want = clip.get_image_features(**pixels)
        else:
            tokens = AutoTokenizer.from_pretrained(path)([raw], return_tensors="pt")
            want = clip.get_text_features(**tokens)
    want = getattr(want, "pooler_output", want)  # transformers >= 5: an output object
    assert feats.shape == (1, 16)  # projection_dim: the projected output, as pooling auto says
    assert torch.allclose(feats, want, atol=1e-5)

    tuned = ModalityConfig.from_dict({"kind": "transformers", "model": str(path), "input": kind,
                                      "train_layers": 1}, "m")  # fmt: skip
    enc = build_encoder(tuned, 8)
    trainable = {n for n, p in enc.tower.named_parameters() if p.requires_grad}  # type: ignore[union-attr]
    mine, other = (("vision_model", "text_model") if kind == "image"
                   else ("text_model", "vision_model"))  # fmt: skip
    projection = "visual_projection" if kind == "image" else "text_projection"
    assert any(n.startswith(f"{mine}.encoder.layers.1.") for n in trainable)
    assert not any(n.startswith(f"{mine}.encoder.layers.0.") for n in trainable)
    assert any(n.startswith(projection) for n in trainable)
    assert not any(n.startswith(other) for n in trainable), sorted(trainable)


@pytest.mark.parametrize("layers", [0, 1])
def test_a_clip_s_embedding_does_not_depend_on_the_clips_batched_with_it(towers, layers) -> None:
    """wav2vec 2.0 base normalises over time (group norm): padded beside a longer clip, a clip
    would get other features. Clips of one length run together, whether the tower is frozen
    or fine-tuned (then in the forward pass, gradients reaching its last block)."""
    cfg = ModalityConfig.from_dict({"kind": "transformers", "model": str(towers["w2v"]),
                                    "input": "audio", "max_seconds": 1.0,
                                    "train_layers": layers}, "m")  # fmt: skip
    enc = build_encoder(cfg, 8)
    short = decode(data_uri("audio/wav", wav(300, seconds=0.3)), cfg)
    long = decode(data_uri("audio/wav", wav(500, seconds=0.8)), cfg)
    alone = enc.encode([short])
    batched = enc.encode([long, short, long])
    assert torch.allclose(batched[1], alone[0], atol=1e-5)
    assert torch.allclose(batched[0], batched[2], atol=1e-5)
    if layers:
        padded = enc(tower_module.load_tower(cfg).inputs([long, short, long]))
        assert not torch.allclose(padded[1], alone[0], atol=1e-3)  # what padding would give
        batched.sum().backward()
        assert enc.tower is not None
        last = [p for n, p in enc.tower.named_parameters() if ".layers.1." in n]
        assert last and all(p.grad is not None and p.grad.abs().sum() > 0 for p in last)


def test_audio_is_resampled_without_folding_what_the_target_rate_cannot_hold(towers) -> None:
    """48 kHz to the processor's 16 kHz: a 1 kHz tone passes, a 12 kHz one (above 8 kHz) is
    filtered out rather than folded to 4 kHz, and a clip cropped to max_seconds is the start
    of the whole file's resampling (the prefix read has the filter's reach)."""
    cfg = ModalityConfig.from_dict({"kind": "transformers", "model": str(towers["w2v"]),
                                    "input": "audio", "max_seconds": 1.0}, "m")  # fmt: skip

    def rms(x: torch.Tensor) -> float:
        return float(x[800:-800].pow(2).mean().sqrt())  # away from the ends

    kept = decode(data_uri("audio/wav", wav(1000, rate=48000, seconds=0.5)), cfg)
    folded = decode(data_uri("audio/wav", wav(12000, rate=48000, seconds=0.5)), cfg)
    assert len(kept) == 8000 and abs(rms(kept) - 0.3 / np.sqrt(2)) < 0.01
    assert rms(folded) < 0.01 * rms(kept)
    long = wav(440, rate=44100, seconds=3.0)
    clip = decode(data_uri("audio/wav", long), cfg)
    full = np.frombuffer(long[44:], dtype="<i2").astype(np.float32) / 32768
    whole = tower_inputs.resample(full, 44100, 16000)
    assert len(clip) == 16000 and np.allclose(clip.numpy(), whole[:16000], atol=1e-5)


def test_bf16_autocast_reaches_a_frozen_tower(towers, tmp_path) -> None:
    """to_inference puts a frozen tower (not a submodule) where the model runs, under its
    autocast: here the CPU in bf16, the path a GPU takes in bf16 (features close to fp32's,
    not equal to them, and float32 on the way out)."""
    from models.config import ModelConfig
    from models.model import MultimodalModel

    config = json.loads(write_config(tmp_path, towers).read_text())
    cfg = ModelConfig.from_dict({k: config[k] for k in ("modalities", "head", "latent_dim")})
    torch.manual_seed(0)
    model = MultimodalModel(cfg)
    image = [decode(data_uri("image/png", png(i)), cfg.modalities["photo"]) for i in range(3)]
    exact = model.to_inference("cpu", "fp32").encoder("photo").collate(image)
    half = model.to_inference("cpu", "bf16").encoder("photo").collate(image)
    assert half.dtype == torch.float32 and not torch.equal(half, exact)
    assert torch.allclose(half, exact, atol=0.1, rtol=0.05)
    model.to_inference("cpu", "fp32")  # the tower is shared by the process: leave it as found


def test_frozen_towers_train_with_the_feature_cache_then_index_and_serve(
    towers, tmp_path, tower_calls, monkeypatch
) -> None:
    monkeypatch.setenv("HCLIP_FEATURE_CACHE", str(tmp_path / "features"))
    config = write_config(tmp_path, towers)
    assert run_cli("train", "--config", config, "--out", tmp_path / "model", "--quiet") == 0
    # epoch 1 ran each tower over the 24 records once; epoch 2 read the cache
    assert sum(tower_calls) == 3 * 24, tower_calls
    tower_calls.clear()
    assert run_cli("train", "--config", config, "--out", tmp_path / "again", "--quiet") == 0
    assert sum(tower_calls) == 0  # a second run: every feature from the cache
    # another tower (new weights): its features are computed anew
    changed = tmp_path / "bert2"
    shutil.copytree(towers["bert"], changed)
    from transformers import BertModel

    model = BertModel.from_pretrained(changed)
    with torch.no_grad():
        model.pooler.dense.weight.add_(1.0)
    model.save_pretrained(changed)
    cfg = json.loads(config.read_text())
    cfg["modalities"]["caption"]["model"] = str(changed)
    config.write_text(json.dumps(cfg))
    tower_calls.clear()
    assert run_cli("train", "--config", config, "--out", tmp_path / "third", "--quiet") == 0
    assert sum(tower_calls) == 24, tower_calls  # only the changed tower ran
    # the fingerprint covers the tower's files: the same tower rewritten is another model
    from models.checkpoint import fingerprint

    before = fingerprint(tmp_path / "third")
    with torch.no_grad():
        model.pooler.dense.weight.add_(1.0)
    model.save_pretrained(changed)
    assert fingerprint(tmp_path / "third") != before

    root = tmp_path / "root"
    assert index_build(tmp_path / "model", tmp_path / "records.jsonl", root) == 0
    with running(settings_for(root)) as client:
        info = client.get("/v1/info").json()
        omega = np.asarray(info["model"]["omega"])
        assert info["model"]["inputs"] == {"photo": "image", "sound": "audio", "caption": "text"}
        r = client.post("/v1/search", json={"query": {"caption": "the number three"}, "k": 5})
        assert r.status_code == 200, r.text
        assert len(r.json()["results"]) == 5
        # a client must not make the server read its files, whatever the encoder kind
        for field, path in (("photo", "/etc/hostname"), ("sound", str(tmp_path / "x.wav"))):
            bad = client.post("/v1/search", json={"query": {field: path}, "k": 5})
            assert bad.status_code == 422, bad.text
            assert f"query.{field}: " in bad.text and "must be a base64 data: URI" in bad.text
        bad = client.post("/v1/embed", json={"modality": "photo", "inputs": ["/etc/hostname"]})
        assert bad.status_code == 422 and "must be a base64 data: URI" in bad.text, bad.text
        q = client.post("/v1/embed", json={"modality": "caption",
                                           "inputs": ["the number three"]}).json()  # fmt: skip
        qe = np.asarray(q["embeddings"][0])
        for hit in r.json()["results"]:
            stored = client.get(f"/v1/records/{hit['id']}/embeddings").json()["embeddings"]
            score = float(np.sum(omega * qe * np.asarray(stored["photo"]) *
                                 np.asarray(stored["sound"])))  # fmt: skip
            assert abs(score - hit["score"]) < 1e-4, (score, hit)


def test_with_an_accelerator_frozen_towers_run_in_the_training_process(
    towers, tmp_path, tower_calls, monkeypatch
) -> None:
    """On a GPU the towers run in the trainer on it, the workers reading the cache and sending
    the inputs it lacks. No GPU here: that path, taken on the CPU, trains the model the
    workers' path trains, fills the cache in epoch 1 and reads it in epoch 2."""
    from models.checkpoint import load_model
    from models.train import trainer as trainer_module

    config = write_config(tmp_path, towers)
    cfg = json.loads(config.read_text())
    cfg["train"]["num_workers"] = 2  # towers called in a worker would not count here
    config.write_text(json.dumps(cfg))
    monkeypatch.setenv("HCLIP_FEATURE_CACHE", "off")
    assert run_cli("train", "--config", config, "--out", tmp_path / "workers", "--quiet") == 0
    assert tower_calls == []  # every tower ran in the workers

    monkeypatch.setattr(trainer_module, "towers_run_in_workers", lambda device: False)
    monkeypatch.setenv("HCLIP_FEATURE_CACHE", str(tmp_path / "features"))
    assert run_cli("train", "--config", config, "--out", tmp_path / "here", "--quiet") == 0
    assert sum(tower_calls) == 3 * 24, tower_calls  # epoch 1 in this process; epoch 2 cached
    for a, b in zip(load_model(tmp_path / "workers").state_dict().items(),
                    load_model(tmp_path / "here").state_dict().items(), strict=True):  # fmt: skip
        assert a[0] == b[0] and torch.allclose(a[1], b[1], atol=1e-5), a[0]
    tower_calls.clear()
    monkeypatch.setenv("HCLIP_FEATURE_CACHE", "off")  # no cache: the towers run every step
    assert run_cli("train", "--config", config, "--out", tmp_path / "nocache", "--quiet") == 0
    assert sum(tower_calls) == 2 * 3 * 24, tower_calls


def test_the_last_block_trains_and_is_saved(towers, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HCLIP_FEATURE_CACHE", "off")
    config = write_config(tmp_path, towers, image="clip", layers=1)
    assert run_cli("train", "--config", config, "--out", tmp_path / "model", "--quiet") == 0
    from models.checkpoint import load_model

    trained = load_model(tmp_path / "model")
    enc = trained.encoder("photo")
    tower = tower_module.load_tower(enc.cfg).model
    mine = dict(enc.tower.named_parameters())  # type: ignore[union-attr]
    theirs = dict(tower.named_parameters())
    last = [n for n in mine if ".layers.1." in n]
    first = [n for n in mine if ".layers.0." in n]
    assert last and first
    assert any(not torch.equal(mine[n], theirs[n]) for n in last)  # fine-tuned
    assert all(torch.equal(mine[n], theirs[n]) for n in first)  # frozen
    root = tmp_path / "root"
    assert index_build(tmp_path / "model", tmp_path / "records.jsonl", root) == 0


def test_a_fine_tuned_audio_tower_trains_on_clips_of_several_lengths(
    towers, tmp_path, monkeypatch
) -> None:
    """Its batches (clips grouped by length) cross the DataLoader's worker processes."""
    monkeypatch.setenv("HCLIP_FEATURE_CACHE", "off")
    config = write_config(tmp_path, towers)
    cfg = json.loads(config.read_text())
    cfg["modalities"]["sound"]["train_layers"] = 1
    cfg["train"]["num_workers"] = 2
    config.write_text(json.dumps(cfg))
    recs = records(24)
    for i, r in enumerate(recs):
        r["sound"] = data_uri("audio/wav", wav(200 + 25 * i, seconds=0.2 + 0.1 * (i % 3)))
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert run_cli("train", "--config", config, "--out", tmp_path / "model", "--quiet") == 0
    from models.checkpoint import load_model

    enc = load_model(tmp_path / "model").encoder("sound")
    tower = tower_module.load_tower(enc.cfg).model
    mine = dict(enc.tower.named_parameters())  # type: ignore[union-attr]
    theirs = dict(tower.named_parameters())
    assert any(not torch.equal(mine[n], theirs[n]) for n in mine if ".layers.1." in n)


def test_a_fine_tuned_tower_is_its_model_s_only_copy_in_the_process(towers) -> None:
    """No frozen copy beside the trainable one (a ViT-B/16's 340 MB in every process that
    builds the model), and preparing its inputs (DataLoader workers) loads the processor only."""
    cfg = ModalityConfig.from_dict({"kind": "transformers", "model": str(towers["clip"]),
                                    "input": "image", "train_layers": 1}, "m")  # fmt: skip
    tower_module._LOADED.clear()
    enc = build_encoder(cfg, 8)
    inputs = enc.collate([decode(data_uri("image/png", png(5)), cfg)])
    assert enc(inputs).shape == (1, 8)
    assert tower_module._LOADED == {}


def test_clear_errors(towers, tmp_path, capsys) -> None:
    missing = tmp_path / "no-such-model"
    cfg = ModalityConfig.from_dict({"kind": "transformers", "model": str(missing),
                                    "input": "image"}, "m")  # fmt: skip
    with pytest.raises(
        PretrainedError,
        match=r"no-such-model does not exist: fetch the tower once on a machine with access .*"
        r"set HCLIP_TOWERS_DIR to a directory that holds it as no-such-model/",
    ):
        build_encoder(cfg, 8)
    hub = ModalityConfig.from_dict({"kind": "transformers", "model": "someone/not-here",
                                    "input": "text"}, "m")  # fmt: skip
    with pytest.raises(PretrainedError, match="nor in the local Hugging Face cache") as err:
        build_encoder(hub, 8)
    assert "`hf download someone/not-here`" in str(err.value)
    assert "`hf download HUB_ID --local-dir someone/not-here`" in str(err.value)
    # a relative path that cannot be a hub id is named as a path, never looked up as one
    nested = ModalityConfig.from_dict({"kind": "transformers", "model": "towers/clip/v1",
                                       "input": "text"}, "m")  # fmt: skip
    with pytest.raises(PretrainedError, match=r"model directory towers/clip/v1 does not exist"):
        build_encoder(nested, 8)
    mixed = tmp_path / "mixed"
    shutil.copytree(towers["vit"], mixed)
    shutil.copy(towers["w2v"] / "preprocessor_config.json", mixed / "preprocessor_config.json")
    bad = ModalityConfig.from_dict({"kind": "transformers", "model": str(mixed),
                                    "input": "image"}, "m")  # fmt: skip
    with pytest.raises(PretrainedError, match="has no usable image processor or model"):
        build_encoder(bad, 8)
    text_to_image = ModalityConfig.from_dict({"kind": "transformers", "model": str(towers["vit"]),
                                              "input": "text"}, "m")  # fmt: skip
    with pytest.raises(PretrainedError, match="has no usable text processor or model"):
        build_encoder(text_to_image, 8)
    image = ModalityConfig.from_dict({"kind": "transformers", "model": str(towers["vit"]),
                                      "input": "image"}, "m")  # fmt: skip
    with pytest.raises(InputError, match="expected a file path or a data: URI"):
        decode(42, image)
    with pytest.raises(ConfigError, match="input: expected one of image, audio, text"):
        ModalityConfig.from_dict({"kind": "transformers", "model": "x", "input": "video"}, "m")
    config = write_config(tmp_path, {**towers, "vit": missing})
    assert run_cli("train", "--config", config, "--out", tmp_path / "model", "--quiet") == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_model_moves_to_another_machine_with_its_towers(towers, tmp_path, monkeypatch) -> None:
    """A saved model names its towers by the paths they had where it was trained; elsewhere
    they are found by their directory names in HCLIP_TOWERS_DIR, and the model's fingerprint
    (a tower is its files) and the versions built with it stay valid."""
    from models.checkpoint import fingerprint
    from models.errors import CheckpointError

    monkeypatch.setenv("HCLIP_FEATURE_CACHE", "off")
    here = tmp_path / "trained-here"
    for name in ("vit", "w2v", "bert"):
        shutil.copytree(towers[name], here / name)
    config = write_config(tmp_path, {**towers, **{n: here / n for n in ("vit", "w2v", "bert")}})
    assert run_cli("train", "--config", config, "--out", tmp_path / "model", "--quiet") == 0
    root = tmp_path / "root"
    assert index_build(tmp_path / "model", tmp_path / "records.jsonl", root) == 0
    before = fingerprint(tmp_path / "model")
    here.rename(tmp_path / "towers-there")  # another machine keeps them elsewhere
    with pytest.raises(CheckpointError, match="set HCLIP_TOWERS_DIR to a directory that holds"):
        fingerprint(tmp_path / "model")
    monkeypatch.setenv("HCLIP_TOWERS_DIR", str(tmp_path / "towers-there"))
    assert fingerprint(tmp_path / "model") == before
    with running(settings_for(root)) as client:
        r = client.post("/v1/search", json={"query": {"caption": "the number three"}, "k": 3})
        assert r.status_code == 200 and len(r.json()["results"]) == 3, r.text
    monkeypatch.setenv("HCLIP_TOWERS_DIR", str(tmp_path / "empty"))
    with pytest.raises(
        CheckpointError, match=r"trained-here/\w+ does not exist, nor does .*/empty/\w+ \(HCLIP"
    ):
        fingerprint(tmp_path / "model")


def test_the_documented_config_trains_with_stand_ins(towers, tmp_path, monkeypatch) -> None:
    """docs/models.md's pretrained-tower config, as written, with tiny models in the
    directories it names (relative to the config)."""
    monkeypatch.setenv("HCLIP_FEATURE_CACHE", str(tmp_path / "features"))
    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    block = text.split("<!-- pretrained-tower config -->")[1].split("```json")[1].split("```")[0]
    cfg = json.loads(block)
    stand_ins = {"clip": towers["clip-full"], "wav2vec2": towers["w2v"], "MiniLM": towers["bert"]}
    for m in cfg["modalities"].values():
        target = next(p for key, p in stand_ins.items() if key in m["model"])
        shutil.copytree(target, tmp_path / m["model"])
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(16)))
    cfg["train"].update(epochs=1, batch_size=8)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "model"
    assert run_cli("train", "--config", tmp_path / "config.json", "--out", out, "--quiet") == 0
    assert index_build(out, tmp_path / "records.jsonl", tmp_path / "root") == 0


def test_a_build_with_torch_threads_and_reader_processes_finishes(towers, tmp_path) -> None:
    """A build with two torch threads and forked reader processes finishes. With real-size
    towers a reader hung sending decoded tensors back through torch's shared-memory pickling
    (benchmarks/bench_towers.py, 2 threads); they now cross as numpy arrays. These tiny towers
    do not reproduce that race: this guards the path, not the race itself."""
    import os
    import subprocess
    import sys

    config = write_config(tmp_path, towers)
    cfg = json.loads(config.read_text())
    from models.checkpoint import save_model
    from models.config import ModelConfig
    from models.model import MultimodalModel

    model_cfg = ModelConfig.from_dict({k: cfg[k] for k in ("modalities", "head", "latent_dim")})
    save_model(MultimodalModel(model_cfg), tmp_path / "model")
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "index", "build", "--model", str(tmp_path / "model"),
         "--records", str(tmp_path / "records.jsonl"), "--root", str(tmp_path / "root"),
         "--quiet", "--batch-size", "8"],
        env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "2"},
        cwd=repo, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_build_sizes_its_chunks_by_the_decoded_inputs(towers, tmp_path) -> None:
    """A chunk of decoded images and clips stays within CHUNK_BYTES, in whole batches; vectors
    keep the full chunk."""
    from indexer.build.local import CHUNK_BYTES, chunk_rows_for
    from models.config import ModelConfig
    from models.encoders import decoded_bytes
    from models.model import MultimodalModel

    config = json.loads(write_config(tmp_path, towers).read_text())
    cfg = ModelConfig.from_dict({k: config[k] for k in ("modalities", "head", "latent_dim")})
    model = MultimodalModel(cfg)
    image = decode(data_uri("image/png", png(5)), cfg.modalities["photo"])
    assert decoded_bytes(cfg.modalities["photo"]) == image.numel() * 4  # (3, 32, 32) float32
    per_record = sum(decoded_bytes(cfg.modalities[n]) or 0 for n in cfg.names)
    rows = chunk_rows_for(model, 32, 8192)
    assert rows % 32 == 0 and rows * per_record <= CHUNK_BYTES < (rows + 32) * per_record
    vectors = ModelConfig.from_dict({"modalities": {"a": {"kind": "vector", "dim": 16},
                                                    "b": {"kind": "vector", "dim": 16}},
                                     "head": "hclip", "latent_dim": 8})  # fmt: skip
    assert chunk_rows_for(MultimodalModel(vectors), 256, 8192) == 8192


def photo_jpeg(w: int, h: int) -> bytes:
    """A photo-like JPEG: smooth colour fields with some grain."""
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    fields = np.stack([np.sin(6 * x + k) * np.cos(4 * y - k) for k in range(3)], -1)
    grain = np.random.default_rng(0).normal(0, 8, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(fields * 90 + 128 + grain, 0, 255).astype(np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("name", ["vit", "clip"])
def test_a_large_jpeg_is_decoded_small_and_preprocessed_as_the_whole_decode_would_be(
    towers, name
) -> None:
    from PIL import Image

    cfg = ModalityConfig.from_dict({"kind": "transformers", "model": str(towers[name]),
                                    "input": "image"}, "m")  # fmt: skip
    assert tower_inputs.image_side(cfg) == 32  # ViT: 32 x 32; CLIP: shortest edge 32, crop 32
    raw = photo_jpeg(640, 400)
    ours = decode(data_uri("image/jpeg", raw), cfg)
    whole = tower_inputs.preprocess_image(Image.open(io.BytesIO(raw)).convert("RGB"), cfg)
    assert ours.shape == whole.shape == (3, 32, 32)
    step = 1 / 255 / 0.5  # a grey level in ViT's normalised units (std 0.5; CLIP's is stricter)
    assert (ours - whole).abs().mean() < step and not torch.equal(ours, whole)


def test_no_smaller_decode_where_the_processor_keeps_the_image_s_size(towers, tmp_path) -> None:
    import transformers as tf

    shutil.copytree(towers["vit"], tmp_path / "vit")
    tf.ViTImageProcessor(do_resize=False).save_pretrained(tmp_path / "vit")
    cfg = ModalityConfig.from_dict({"kind": "transformers", "model": str(tmp_path / "vit"),
                                    "input": "image"}, "m")  # fmt: skip
    assert tower_inputs.image_side(cfg) is None
