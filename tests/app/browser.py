"""Headless Chromium driving the search page (Debian's chromium and chromium-driver)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


def chrome():  # type: ignore[no-untyped-def]
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver:
        pytest.fail("chromium and chromium-driver are not installed (.ci/run installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    # As root, in a closed network: no sandbox, and none of Chromium's background connections.
    for flag in (
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
        f"--user-data-dir={tempfile.mkdtemp(prefix='hclip-chrome-')}",
    ):
        opts.add_argument(flag)
    return webdriver.Chrome(options=opts, service=Service(driver))


def search_with_examples(url: str, screenshot: Path, picks: dict[str, int]) -> list[str]:
    """Open the page, pick the given example of each kind (kind -> position), search; the
    results' texts."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chrome()
    try:
        driver.get(url)
        wait = WebDriverWait(driver, 30)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
        for kind, position in picks.items():
            example = driver.find_elements(By.CSS_SELECTOR, f"[data-example={kind}]")[position]
            example.click()
            wait.until(lambda d, e=example: "selected" in (e.get_attribute("class") or ""))
        driver.find_element(By.ID, "search").click()
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#results li")))
        driver.save_screenshot(str(screenshot))
        return [li.text for li in driver.find_elements(By.CSS_SELECTOR, "#results li")]
    finally:
        driver.quit()
