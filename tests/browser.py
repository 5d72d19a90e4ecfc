"""A headless Chromium driven by Selenium, for the browser tests and scripts/screenshots.py.

Debian's ``chromium`` and ``chromium-driver`` packages (scripts/setup.sh installs them where apt
is available); :func:`missing` says why a browser cannot be had, for a clear skip reason."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import SessionNotCreatedException, TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.other_user import SESSION_ENV

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)


def missing() -> str | None:
    """Why no browser can run here, or None."""
    if not any(shutil.which(b) for b in BROWSERS):
        return "no Chromium on PATH (apt-get install chromium chromium-driver)"
    if not any(shutil.which(d) for d in DRIVERS):
        return "no chromedriver on PATH (apt-get install chromium-driver)"
    return None


def chrome(width: int = 1280, height: int = 800) -> webdriver.Chrome:
    """A headless Chromium with a profile folder of its own (made private in the temporary folder):
    two browsers on the default profile share its lock, and the second exits at start."""
    options = Options()
    profile = tempfile.mkdtemp(prefix="chromium-")
    for arg in (
        f"--user-data-dir={profile}",
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        "--hide-scrollbars",
    ):
        options.add_argument(arg)
    binary = next(b for b in map(shutil.which, BROWSERS) if b)
    options.binary_location = binary
    log = Path(profile) / "chromedriver.log"
    # Chromium's singleton socket lives in its TMPDIR, and a Unix socket path holds 107 bytes: a
    # worker's deep pytest folders overflow it ("Socket path too long"), so it gets a short one.
    short = tempfile.mkdtemp(prefix="c-", dir=os.environ.get(SESSION_ENV) or None)
    service = Service(
        next(d for d in map(shutil.which, DRIVERS) if d),
        service_args=["--verbose"],
        log_output=str(log),
        env={**os.environ, "TMPDIR": short},
    )
    try:
        driver = webdriver.Chrome(options=options, service=service)
    except SessionNotCreatedException as e:  # say why Chromium exited: its driver's log ends with it
        tail = log.read_text(errors="replace")[-4000:] if log.is_file() else "(no driver log)"
        raise SessionNotCreatedException(f"{e.msg}\nchromedriver's log ends:\n{tail}") from None
    # The log is for a failed start; from here on it would record every command, a typed login
    # included, so its name goes (the driver writes on to a file no path reaches).
    log.unlink()
    return driver


def send_login(driver: webdriver.Chrome, username: str, password: str) -> None:
    """Every request the browser makes from now on carries the login as HTTP basic auth (what a
    person types into the browser's prompt for MLflow and optuna-dashboard)."""
    import base64

    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})


def log_in_to_prefect(driver: webdriver.Chrome, ui: str, auth_string: str, timeout: float = 60) -> None:
    """Prefect's UI asks for its auth string (``user:password``) on a login page; type it there."""
    from selenium.webdriver.common.keys import Keys

    driver.get(f"{ui}/dashboard")
    field = WebDriverWait(driver, timeout).until(lambda d: d.find_element(By.CSS_SELECTOR, "input[type=password]"))
    field.send_keys(auth_string, Keys.ENTER)
    WebDriverWait(driver, timeout).until(lambda d: not d.find_elements(By.CSS_SELECTOR, "input[type=password]"))


def page_text(driver: webdriver.Chrome) -> str:
    return driver.find_element(By.TAG_NAME, "body").text


def wait_for_text(driver: webdriver.Chrome, *needles: str, timeout: float = 60) -> str:
    """Wait until the page shows every needle; returns the page text. A timeout names the needles
    the page never showed, and the page's text, so a failure says what the UI showed instead."""
    try:
        WebDriverWait(driver, timeout).until(lambda d: all(n in page_text(d) for n in needles))
    except TimeoutException:
        shown = page_text(driver)
        missing = [n for n in needles if n not in shown]
        raise TimeoutException(f"{driver.current_url} never showed {missing}; it showed:\n{shown[:3000]}") from None
    return page_text(driver)


def image_loads(driver: webdriver.Chrome, url: str) -> bool:
    """Open an image by URL: it loads when the browser decoded it to a non-empty size."""
    driver.get(url)
    return bool(
        driver.execute_script("const img = document.images[0]; return img && img.complete && img.naturalWidth > 0")
    )
