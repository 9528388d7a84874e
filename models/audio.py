"""Log-mel spectrograms computed with torch alone (torchaudio does not load beside this torch)."""

from __future__ import annotations

import math

import torch


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
