"""Headless Chromium driving the search page (Debian's chromium and chromium-driver).

`SearchPage` does what a user does: pick a held-out example, upload a file, record from the
microphone (a fake capture device that plays a WAV file), search, and read the results.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import wave
from pathlib import Path
from typing import Any

import pytest

# As root, in a closed network: no sandbox, and none of Chromium's background connections.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
    "--autoplay-policy=no-user-gesture-required",
)


def chrome(microphone: Path | None = None) -> Any:
    """A headless Chromium; with `microphone`, getUserMedia is granted without a prompt and
    records that WAV file (Chromium loops it) instead of a real device."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver:
        pytest.fail("chromium and chromium-driver are not installed (.ci/run installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='hclip-chrome-')}")
    if microphone is not None:
        opts.add_argument("--use-fake-ui-for-media-stream")
        opts.add_argument("--use-fake-device-for-media-stream")
        opts.add_argument(f"--use-file-for-fake-audio-capture={microphone}")
    return webdriver.Chrome(options=opts, service=Service(driver))


class SearchPage:
    """The page at `url` in a fresh browser; use as a context manager."""

    def __init__(
        self, url: str, microphone: Path | None = None, timeout: float = 30.0, key: str = ""
    ):
        self.url, self.microphone, self.timeout, self.key = url, microphone, timeout, key

    def __enter__(self) -> SearchPage:
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver = chrome(self.microphone)
        try:
            self.driver.get(self.url)
            self.wait = WebDriverWait(self.driver, self.timeout)
            if self.key:  # the page asks for the server's read key, as it does a user
                self.wait.until(lambda d: self._css("#key-form")[0].is_displayed())
                self._css("#key")[0].send_keys(self.key)
                self._css("#key-form button, #key-form input[type=submit]")[0].click()
            self.wait.until(lambda d: self._css("body")[0].get_attribute("data-ready") == "1")
        except BaseException:
            self.driver.quit()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.driver.quit()

    def _css(self, selector: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return list(self.driver.find_elements(By.CSS_SELECTOR, selector))

    def chosen(self, modality: str) -> str:
        """What the modality's box says is in the query."""
        return str(self._css(f"#mod-{modality} .chosen")[0].text)

    def _wait_chosen(self, modality: str, prefix: str) -> str:
        self.wait.until(lambda d: self.chosen(modality).startswith(prefix))
        return self.chosen(modality)

    def pick(self, kind: str, position: int) -> None:
        """Click the held-out example of `kind` at `position`."""
        example = self._css(f"[data-example={kind}]")[position]
        example.click()
        self.wait.until(lambda d: "selected" in (example.get_attribute("class") or ""))

    def upload(self, modality: str, path: Path) -> str:
        """Choose `path` in the modality's file input, as the file dialog would."""
        self._css(f"#mod-{modality} input[type=file]")[0].send_keys(str(path.resolve()))
        return self._wait_chosen(modality, "uploaded")

    def record(self, modality: str) -> str:
        """Press the modality's record button and wait for the recording to become the query."""
        self._css(f"#mod-{modality} [data-action=record]")[0].click()
        return self._wait_chosen(modality, "your recording")

    def type_text(self, modality: str, text: str) -> str:
        """Type into the modality's text box, as a user does (appending to what is there)."""
        self._css(f"#mod-{modality} input[type=text]")[0].send_keys(text)
        return self.chosen(modality)

    def clear(self, modality: str) -> None:
        self._css(f"#mod-{modality} h3 button")[0].click()
        self.wait.until(lambda d: self.chosen(modality) == "not in the query")

    def text_box(self, modality: str) -> str:
        return str(self._css(f"#mod-{modality} input[type=text]")[0].get_attribute("value"))

    def _press_search(self) -> None:
        body = self._css("body")[0]
        before = int(body.get_attribute("data-searches") or 0)
        self._css("#search")[0].click()
        self.wait.until(lambda d: int(body.get_attribute("data-searches") or 0) > before)

    def search(self) -> list[str]:
        """Press Search and wait for the answer; the results' texts (an error fails the test)."""
        self._press_search()
        assert not self.error(), self.error()
        return [li.text for li in self._css("#results li")]

    def search_failing(self) -> str:
        """Press Search and wait for the answer, which must be an error; its text."""
        self._press_search()
        assert self.error(), "the search was answered without an error"
        return self.error()

    def images_shown(self, selector: str) -> bool:
        """Every image that `selector` finds has loaded (the browser decoded its pixels)."""
        return bool(
            self.driver.execute_script(
                "const imgs = [...document.querySelectorAll(arguments[0])];"
                "return imgs.length > 0 && imgs.every((i) => i.complete && i.naturalWidth > 0);",
                selector,
            )
        )

    def set_k(self, value: str) -> None:
        box = self._css("#k")[0]
        box.clear()
        box.send_keys(value)

    def task(self) -> str:
        return str(self._css("#task")[0].text)

    def card_meta(self) -> list[str]:
        """Each result card's digits line, as shown."""
        return [str(m.text) for m in self._css("#results li .meta")]

    def overflows(self) -> bool:
        """The page is wider than the window: it scrolls sideways."""
        return bool(
            self.driver.execute_script(
                "return document.documentElement.scrollWidth > window.innerWidth;"
            )
        )

    def results(self) -> list[Any]:
        return self._css("#results li")

    def voices(self) -> list[str]:
        """The voices the spoken examples' rows are labelled with."""
        return [str(r.get_attribute("data-voice")) for r in self._css("[data-voice]")]

    def lead_and_minor(self, card: Any) -> tuple[list[str], list[str]]:
        """The modalities a result card leads with, and those it shows smaller."""
        from selenium.webdriver.common.by import By

        def names(selector: str) -> list[str]:
            found = card.find_elements(By.CSS_SELECTOR, f"{selector} [data-modality]")
            return sorted(str(n.get_attribute("data-modality")) for n in found)

        return names(".lead"), names(".minor")

    def result_meta(self) -> str:
        return str(self._css("#result-meta")[0].text)

    def error(self) -> str:
        e = self._css("#error")[0]
        return "" if e.get_attribute("hidden") is not None else str(e.text)

    def screenshot(self, path: Path) -> None:
        self.driver.save_screenshot(str(path))

    def full_screenshot(self, path: Path) -> None:
        """The whole page, as wide and as tall as its content (Chrome's DevTools protocol): a
        page that overflows its window sideways makes a picture wider than the window."""
        import base64

        size = self.driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.driver.execute_cdp_cmd(
            "Page.captureScreenshot", {"captureBeyondViewport": True, "clip": clip}
        )
        path.write_bytes(base64.b64decode(shot["data"]))


def search_with_examples(url: str, screenshot: Path, picks: dict[str, int]) -> list[str]:
    """Open the page, pick the given example of each kind (kind -> position), search; the
    results' texts."""
    with SearchPage(url) as page:
        for kind, position in picks.items():
            page.pick(kind, position)
        texts = page.search()
        page.screenshot(screenshot)
    return texts


def microphone_wav(demo_dir: Path, example: int, out_dir: Path) -> Path:
    """The demo's held-out audio example number `example` with silence around it: what
    Chromium's fake microphone plays, looped (--use-file-for-fake-audio-capture)."""
    clip = json.loads((demo_dir / "examples.json").read_text())["audio"][example]["url"]
    with wave.open(str(demo_dir / clip.removeprefix("/media/"))) as w:
        rate, frames = w.getframerate(), w.readframes(w.getnframes())
    path = out_dir / "microphone.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        silence = b"\0\0" * int(0.4 * rate)
        w.writeframes(silence + frames + silence * 3)
    return path
