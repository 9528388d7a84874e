"""`audio`: a PCM WAV clip, resampled and cropped or padded to `max_seconds`, as a log-mel
spectrogram computed in torch (torchaudio does not load beside this torch), then the same small
CNN as `image`.

Limits are checked from the WAV header before any sample is read, and only the frames the
encoder's max_seconds needs are read, however long the file says it is."""

from __future__ import annotations

import io
import math
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ModalityConfig
from models.encoders.base import ProjectedEncoder, small_cnn
from models.encoders.media import read_bytes
from models.limits import DEFAULT_LIMITS, InputError, InputLimits, InputTooLarge


def _pcm_to_float(frames: bytes, width: int, channels: int) -> np.ndarray:
    """PCM frames -> mono float32 samples; `frames` holds whole frames (_read_wav refuses a
    file cut short of what its header declares)."""
    if width == 1:
        x = (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        raw = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3)
        ints = raw[:, 0].astype(np.int32) | (raw[:, 1].astype(np.int32) << 8)
        ints |= raw[:, 2].astype(np.int32) << 16
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
        x = ints.astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = np.frombuffer(frames, dtype="<i4").astype(np.float32) / float(1 << 31)
    else:
        raise InputError(f"audio sample width of {width} bytes is not supported")
    return x.reshape(-1, channels).mean(axis=1)


@dataclass(frozen=True)
class WavHeader:
    rate: int
    width: int  # bytes per sample
    channels: int
    nframes: int  # as the header declares them
    data_at: int  # where the samples begin in the file

    @property
    def seconds(self) -> float:
        return self.nframes / self.rate


def wav_header(data: bytes, limits: InputLimits) -> WavHeader:
    """A WAV file's header, its limits checked; no sample is read. `data` may be the file's
    first bytes only."""
    failure: InputError | None = None
    try:
        buf = io.BytesIO(data)
        with wave.open(buf, "rb") as w:
            # wave stops at the data chunk's header: the file's position is its first sample
            header = WavHeader(
                w.getframerate(), w.getsampwidth(), w.getnchannels(), w.getnframes(), buf.tell()
            )
    except Exception:  # wave raises wave.Error, EOFError, struct.error... on hostile bytes
        failure = InputError("audio could not be decoded (expected a PCM WAV file)")
    if failure is not None:
        raise failure  # outside the except block: no context chain to wave's frames
    if header.channels <= 0 or header.channels > 64:
        raise InputError(f"audio WAV header is invalid ({header.channels} channels)")
    if not limits.min_sample_rate <= header.rate <= limits.max_sample_rate:
        raise InputTooLarge(
            f"audio sample rate {header.rate} Hz is outside the accepted range "
            f"{limits.min_sample_rate}-{limits.max_sample_rate} Hz "
            "(min_sample_rate, max_sample_rate)"
        )
    if header.seconds > limits.max_audio_seconds:
        raise InputTooLarge(
            f"audio is {header.seconds:.1f} s long, over the limit of "
            f"{limits.max_audio_seconds:g} s (max_audio_seconds)"
        )
    return header


def _read_wav(
    data: bytes, cfg: ModalityConfig, limits: InputLimits, margin_s: float = 0.0
) -> tuple[np.ndarray, int, int]:
    """(mono samples of a prefix, frames in the whole file, rate): only the frames that the
    encoder's max_seconds (and `margin_s` more) needs are read, however long the file says
    it is. A file holding fewer bytes than its header declares is cut: refused, as a
    truncated upload is."""
    h = wav_header(data, limits)
    frame_bytes = h.width * h.channels
    held = len(data) - h.data_at
    if held < h.nframes * frame_bytes:
        raise InputError(
            f"audio is truncated: its header declares {h.nframes} frames ({h.seconds:.2f} s), "
            f"the file holds {max(held, 0) // frame_bytes}"
        )
    scale = h.rate / cfg.sample_rate  # input samples per output sample
    need = math.ceil(((cfg.max_seconds + margin_s) * cfg.sample_rate + 1) * scale) + 2
    frames = data[h.data_at : h.data_at + min(h.nframes, need) * frame_bytes]
    return _pcm_to_float(frames, h.width, h.channels), h.nframes, h.rate


def _resample_prefix(x: np.ndarray, total: int, rate: int, target: int, n: int) -> np.ndarray:
    """The first n samples of the linear resampling of a `total`-sample signal from `rate` to
    `target`, of which x holds a prefix long enough: what torch's
    interpolate(size=round(total * target / rate), mode="linear") gives over the whole signal
    (up to its float32 rounding of source positions), at a cost bounded by n whatever the
    file's length or rate."""
    size = max(1, round(total * target / rate))
    step = total / size
    pos = np.maximum((np.arange(min(n, size)) + 0.5) * step - 0.5, 0.0)
    i0 = np.minimum(pos.astype(np.int64), total - 1)
    i1 = np.minimum(i0 + 1, total - 1)
    frac = (pos - i0).astype(np.float32)
    return x[i0] * (np.float32(1.0) - frac) + x[i1] * frac


def decode_audio(
    value: Any,
    cfg: ModalityConfig,
    base_dir: Path | None = None,
    limits: InputLimits = DEFAULT_LIMITS,
) -> torch.Tensor:
    """A mono waveform at cfg.sample_rate, cropped or zero-padded to cfg.max_seconds."""
    data = read_bytes(value, base_dir, "audio", limits)
    samples, total, rate = _read_wav(data, cfg, limits)
    if total == 0:
        raise InputError("audio holds no samples")
    n = math.ceil(cfg.max_seconds * cfg.sample_rate)
    if rate != cfg.sample_rate:
        samples = _resample_prefix(samples, total, rate, cfg.sample_rate, n)
    out = np.zeros(n, dtype=np.float32)
    m = min(n, len(samples))
    out[:m] = samples[:m]
    return torch.from_numpy(out)  # (n,)


def _hz_to_mel(hz: float) -> float:
    return 2595.0 * math.log10(1.0 + hz / 700.0)


def mel_filterbank(n_mels: int, n_fft: int, sample_rate: int) -> torch.Tensor:
    """Triangular HTK-style filters, (n_mels, n_fft // 2 + 1)."""
    n_freqs = n_fft // 2 + 1
    freqs = torch.linspace(0.0, sample_rate / 2.0, n_freqs)  # (F,)
    mel_points = torch.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2.0), n_mels + 2)
    hz_points = 700.0 * (10.0 ** (mel_points / 2595.0) - 1.0)  # (n_mels + 2,)
    lower, center, upper = hz_points[:-2, None], hz_points[1:-1, None], hz_points[2:, None]
    rising = (freqs[None] - lower) / (center - lower).clamp(min=1e-6)
    falling = (upper - freqs[None]) / (upper - center).clamp(min=1e-6)
    return torch.clamp(torch.minimum(rising, falling), min=0.0)  # (n_mels, F)


class LogMel(torch.nn.Module):
    """Waveform (B, T) -> normalised log-mel spectrogram (B, 1, n_mels, frames)."""

    def __init__(self, sample_rate: int, n_mels: int, win_ms: float = 25.0, hop_ms: float = 10.0):
        super().__init__()
        self.n_fft = round(sample_rate * win_ms / 1000.0)
        self.hop = round(sample_rate * hop_ms / 1000.0)
        # Buffers, not parameters: they are fixed by the config and need not be checkpointed.
        self.register_buffer("window", torch.hann_window(self.n_fft), persistent=False)
        self.register_buffer(
            "fbank", mel_filterbank(n_mels, self.n_fft, sample_rate), persistent=False
        )

    window: torch.Tensor
    fbank: torch.Tensor

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(
            wave, n_fft=self.n_fft, hop_length=self.hop, window=self.window, return_complex=True
        )  # (B, F, frames)
        power = spec.abs().pow(2)
        mel = torch.einsum("mf,bft->bmt", self.fbank, power)  # (B, n_mels, frames)
        logmel = torch.log(mel + 1e-6)
        # Per-clip standardisation makes the encoder indifferent to recording gain.
        mean = logmel.mean(dim=(1, 2), keepdim=True)
        std = logmel.std(dim=(1, 2), keepdim=True).clamp(min=1e-3)
        return ((logmel - mean) / std)[:, None]  # (B, 1, n_mels, frames)


class AudioEncoder(ProjectedEncoder):
    """Log-mel spectrogram of the waveform, then the same small CNN as for images."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        self.logmel = LogMel(cfg.sample_rate, cfg.n_mels, hop_ms=cfg.hop_ms)
        self.cnn = small_cnn(1, cfg.conv_width, cfg.hidden)

    @staticmethod
    def decode(value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits) -> Any:
        return decode_audio(value, cfg, base_dir, limits)

    @staticmethod
    def example(cfg: ModalityConfig) -> Any:
        return torch.zeros(math.ceil(cfg.max_seconds * cfg.sample_rate))

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.cnn(self.logmel(batch))  # (B, hidden)
