"""Frozen pretrained towers under ONNX Runtime (`HCLIP_ENCODER_RUNTIME=onnx | onnx-int8`).

The tower's forward and its pooling (models.encoders.towers.Tower) are exported once with
`torch.onnx.export` (the dynamo exporter: batch, and token or sample counts, stay dynamic) and
kept under the runtime's `cache_dir` (the service: `<model dir>/onnx/`), one directory per
graph named by a key over the tower's files (models.encoders.tower_files.identity), its input
kind and pooling, and the torch and transformers versions that exported it: a changed tower
is exported again, an unchanged one never. `onnx-int8` quantises that fp32 graph with
onnxruntime's dynamic int8 quantisation, cached likewise. The processor still runs in Python,
so inputs are prepared exactly as on the torch path.

A graph is written in a temporary directory and renamed into place under a file lock, so
workers that start together export it once and never read a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ConfigError, ModalityConfig
from models.encoders.clip_groups import by_length, in_batch_order
from models.encoders.runtime import Runtime
from models.encoders.tower_files import identity
from models.encoders.tower_inputs import example_input
from models.encoders.towers import (
    Processor,
    Tower,
    load_processor,
    load_tower,
    load_weights,
    release_tower,
)
from models.errors import PretrainedError
from models.extras import load_onnxruntime, require_onnx
from models.machine import usable_cores

log = logging.getLogger(__name__)

GRAPH_FILE = "model.onnx"
# Bumped when what is exported changes (the wrapper, the exporter's options): old graphs are
# then ignored, not reused.
EXPORT_VERSION = 1


def graph_key(cfg: ModalityConfig) -> str:
    """What a tower's exported graph depends on: its files, how it is run, and the exporter."""
    import transformers

    assert cfg.model is not None
    what = {
        "tower": identity(cfg.model),
        "input": cfg.input,
        "pooling": cfg.pooling,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "export": EXPORT_VERSION,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def graph_dir(cfg: ModalityConfig, runtime: Runtime) -> Path:
    """Where the runtime's graph of this tower lies (`<tower>-<input>-<key>[-int8]`)."""
    if runtime.cache_dir is None:
        raise ConfigError(f"encoder runtime {runtime.name}: no directory to keep its graphs in")
    assert cfg.model is not None
    suffix = "-int8" if runtime.name == "onnx-int8" else ""
    name = f"{Path(cfg.model).name}-{cfg.input}-{graph_key(cfg)}{suffix}"
    return runtime.cache_dir / name


class Pooled(nn.Module):
    """The tower's forward and pooling as one module of positional tensors: what is exported."""

    def __init__(self, tower: Tower, names: list[str]):
        super().__init__()
        self.tower, self.names, self.model = tower, names, tower.model

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        inputs = dict(zip(self.names, tensors, strict=True))
        return self.tower.pooled(self.tower.forward(self.model, inputs), inputs)  # (B, H)


def export_examples(cfg: ModalityConfig) -> list[Any]:
    """Two inputs to trace with (two, so that the batch is not specialised to one); texts of
    unequal length, so that the trace sees padding."""
    if cfg.input == "text":
        return ["a first query", "and a second, longer query to pad the first"]
    return [example_input(cfg), example_input(cfg)]


def export_graph(cfg: ModalityConfig, dest: Path) -> None:
    """Write the fp32 graph of the tower's forward and pooling to `dest` / model.onnx."""
    # a copy of its own, read from the files the key was made of (not the process's shared
    # one, which may predate a change to them), let go once exported
    tower = Tower(load_weights(cfg), load_processor(cfg), cfg.pooling)
    inputs = tower.inputs(export_examples(cfg))
    names = list(inputs)
    dim = torch.export.Dim.DYNAMIC
    # images are the processor's size: only the batch varies; tokens and samples vary too
    shapes = tuple({0: dim} if cfg.input == "image" else {0: dim, 1: dim} for _ in names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracing chatter
        try:
            program = torch.onnx.export(
                Pooled(tower, names).eval(),
                tuple(inputs[n] for n in names),
                dynamo=True,
                input_names=names,
                output_names=["features"],
                dynamic_shapes=(shapes,),
                verbose=False,
            )
        except Exception as exc:  # the exporter's own errors: the service refuses the version
            raise PretrainedError(
                f"{cfg.model}: torch.onnx could not export it ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); serve it with "
                "HCLIP_ENCODER_RUNTIME=torch"
            ) from exc
    assert program is not None
    program.save(str(dest / GRAPH_FILE))


def quantize_graph(fp32: Path, dest: Path) -> None:
    """onnxruntime's dynamic int8 quantisation (weights int8, activations quantised per call).
    Per channel: with one scale per tensor, all-MiniLM-L6-v2's features kept a cosine of 0.93
    to fp32's, with one per output channel 0.99."""
    load_onnxruntime("int8 quantisation")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    external = any(p.name != GRAPH_FILE for p in fp32.iterdir())  # a graph over 2 GB
    quantize_dynamic(
        fp32 / GRAPH_FILE,
        dest / GRAPH_FILE,
        weight_type=QuantType.QInt8,
        per_channel=True,
        use_external_data_format=external,
    )


def ensure_graph(cfg: ModalityConfig, runtime: Runtime) -> Path:
    """The graph's directory, exported (and quantised) first if it is not there yet."""
    from filelock import FileLock

    final = graph_dir(cfg, runtime)
    if (final / GRAPH_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / GRAPH_FILE).is_file():  # another worker made it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            if runtime.name == "onnx-int8":
                quantize_graph(ensure_graph(cfg, Runtime("onnx", runtime.cache_dir)), tmp)
            else:
                export_graph(cfg, tmp)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s (%s input) for %s to %s", cfg.model, cfg.input, runtime.name, final)
    return final


class OnnxTower:
    """A tower's graph in an ONNX Runtime session, with the torch path's processor: decoded
    inputs -> (B, H) float32 pooled features, as Tower.__call__ gives them.

    A session's thread count is fixed when it is made, where torch's is set per call: the
    service grants each encode call its threads (app.services.core_share) through
    torch.set_num_threads in the encode thread. So a call granted every core (a lone query,
    no other encode running) runs in a second session with every core's thread; any other
    grant runs in the session of `threads`. Both are made here, before the worker serves: the
    first lone query does not wait for a session (graph optimisation, allocation). The second
    session holds a second copy of the weights: that is the price of a lone query at the
    tower's full pace (ViT-B/16 on two cores: docs/benchmarks/tower_serving.md)."""

    def __init__(self, prep: Processor, path: Path, threads: int, cores: int | None = None):
        self.prep = prep
        self.path = path
        self.threads = max(1, threads)
        self.cores = max(self.threads, cores or usable_cores())
        self._sessions: dict[int, Any] = {}
        self._lock = threading.Lock()
        session = self._session(self.threads)
        self.names = [i.name for i in session.get_inputs()]  # the exporter drops unused ones
        self._session(self.cores)

    def _session(self, threads: int) -> Any:
        with self._lock:
            session = self._sessions.get(threads)
            if session is None:
                ort = load_onnxruntime("an ONNX tower")
                opts = ort.SessionOptions()
                opts.intra_op_num_threads = threads
                opts.inter_op_num_threads = 1
                opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
                # idle threads sleep, as torch's do in the service (OMP_WAIT_POLICY=PASSIVE)
                opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
                session = ort.InferenceSession(
                    str(self.path / GRAPH_FILE), opts, providers=["CPUExecutionProvider"]
                )
                self._sessions[threads] = session
            return session

    def session_for_call(self) -> Any:
        """The session for this call: every core's when the calling thread was granted them."""
        every = self.cores > self.threads and torch.get_num_threads() >= self.cores
        return self._session(self.cores if every else self.threads)

    def __call__(self, items: list[Any]) -> torch.Tensor:
        # clips of one length together, as on the torch path (Tower.__call__ says why)
        if self.prep.input != "audio" or len({len(x) for x in items}) <= 1:
            return self._run(items)
        return in_batch_order([(where, self._run(group)) for where, group in by_length(items)])

    def _run(self, items: list[Any]) -> torch.Tensor:
        inputs = self.prep(items)
        feed = {n: np.ascontiguousarray(inputs[n].numpy()) for n in self.names}
        (out,) = self.session_for_call().run(["features"], feed)
        return torch.from_numpy(out)  # (B, H)


_SESSIONS: dict[tuple[Path, int], OnnxTower] = {}
_LOCK = threading.Lock()


def load_onnx_tower(cfg: ModalityConfig, runtime: Runtime) -> OnnxTower:
    """The tower under `runtime`, exported if need be, one session per process and graph (a
    tower whose files change gets a new one). The process's torch copy, if any, is let go:
    the process keeps one copy of the weights."""
    require_onnx(f"encoder runtime {runtime.name}")
    path = graph_dir(cfg, runtime)
    with _LOCK:
        if (path, runtime.threads) not in _SESSIONS:
            ensure_graph(cfg, runtime)
            _SESSIONS[path, runtime.threads] = OnnxTower(load_processor(cfg), path, runtime.threads)
            release_tower(cfg)
        return _SESSIONS[path, runtime.threads]


def tower_runner(cfg: ModalityConfig, runtime: Runtime) -> Callable[[list[Any]], torch.Tensor]:
    """What computes the frozen tower's pooled features under `runtime`."""
    if runtime.onnx:
        return load_onnx_tower(cfg, runtime)
    return load_tower(cfg)
