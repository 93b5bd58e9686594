"""A real headless browser for the console's tests: Debian's chromium and chromium-driver, driven by selenium
(.ci/run installs them). Never skipped: a machine without them fails the test with how to install them."""

from __future__ import annotations

import shutil
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
DRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
SHOTS = Path(__file__).resolve().parent.parent / "docs" / "console"


def _first(paths: tuple[str, ...], name: str) -> str:
    found = next((p for p in paths if Path(p).exists()), None) or shutil.which(name)
    if found is None:
        raise RuntimeError(f"no {name}: install Debian's chromium and chromium-driver (apt-get install chromium "
                           f"chromium-driver), as .ci/run does")
    return found


def headless(javascript: bool = True) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = _first(CHROMIUM, "chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--no-first-run"):
        options.add_argument(arg)
    if not javascript:
        options.add_experimental_option("prefs", {"profile.managed_default_content_settings.javascript": 2})
    driver = webdriver.Chrome(service=Service(_first(DRIVER, "chromedriver")), options=options)
    driver.set_page_load_timeout(30)
    return driver


def screenshot(driver: webdriver.Chrome, name: str) -> None:
    """docs/console/NAME.png: the README shows them; each test run writes them anew."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.body.scrollHeight") or 1000
    driver.set_window_size(1400, min(max(int(height) + 40, 600), 2400))
    driver.save_screenshot(str(SHOTS / f"{name}.png"))
    driver.set_window_size(1400, 1000)
