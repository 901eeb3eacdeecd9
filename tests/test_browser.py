"""One click: the matrix deployment started from the Prefect UI's run form, in a real browser.

`lanebench serve` on PostgreSQL with Prefect's UI on, and Debian's Chromium driven headless by
its chromedriver (selenium). The test opens the matrix deployment's run form, types the matrix
file into the `matrix_file` field, submits, and follows the run the UI opened to its end: the run
completes, its run folder is there and verifies, and its report artifact is on the run's page.
LANEBENCH_SCREENSHOTS=docs/img keeps the screenshots docs/nightly.md shows.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from prefect_stack import api_call, free_port
from test_deployments import _Lines
from test_team import _inventory, _matrix

pytest_plugins = ["pg_fixture"]

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000"]
LANE_PORT = 18660  # this file's lane ports: 18660-18669


@pytest.fixture(scope="module")
def ui(postgres, llama_bin, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui")
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for dep in spec["deployments"]:
        if dep["name"] == "matrix":  # the run folder in the test's folder, not the checkout's artifacts/
            dep["parameters"] = {"artifacts_root": str(tmp / "artifacts")}
    prefect_file = tmp / "prefect.yaml"
    prefect_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LANEBENCH_NOTIFY"))}
    env |= {"PREFECT_UI_ENABLED": "true", "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_LOGGING_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--port", str(port), "--home",
                             str(tmp / "prefect"), "--prefect-file", str(prefect_file), "--database",
                             postgres.create_database("prefect_ui")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        _Lines(proc).until("Ctrl-C stops", 300)
        yield {"url": f"http://127.0.0.1:{port}", "api": f"http://127.0.0.1:{port}/api", "tmp": tmp}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="lanebench-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"),
                              options=options)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        try:  # what the browser showed last, for a failed run (the test's tmp folder)
            driver.save_screenshot(str(Path(profile).parent / "lanebench-ui-last.png"))
            (Path(profile).parent / "lanebench-ui-last.html").write_text(driver.page_source)
        except Exception:
            pass
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _shot(driver, tmp: Path, name: str) -> None:
    driver.save_screenshot(str(tmp / name))
    if keep := os.environ.get("LANEBENCH_SCREENSHOTS"):
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp / name, Path(keep) / name)


def test_the_matrix_run_form_in_the_ui_runs_the_matrix(ui, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    tmp = ui["tmp"]
    matrix_file = _matrix(tmp, _inventory(tmp / "inventory", LANE_PORT), "one-click")
    dep = next(d for d in api_call(ui["api"], "POST", "/deployments/filter", json={}).json() if d["name"] == "matrix")
    wait = WebDriverWait(browser, 180)
    browser.get(f"{ui['url']}/deployments/deployment/{dep['id']}/run")
    # The run form: one field per parameter of the flow's signature; matrix_file is required.
    field = wait.until(ec.element_to_be_clickable(
        (By.XPATH, "//*[normalize-space(text())='matrix_file']/following::textarea[1]")))
    field.click()
    field.send_keys(str(matrix_file), Keys.TAB)
    _shot(browser, tmp, "ui-matrix-run-form.png")
    wait.until(ec.element_to_be_clickable((By.XPATH, "//button[normalize-space(.)='Submit']"))).click()
    wait.until(lambda d: not d.current_url.rstrip("/").endswith("/run"))  # the UI leaves the form once the run exists
    runs = api_call(ui["api"], "POST", "/flow_runs/filter",
                    json={"deployments": {"id": {"any_": [dep["id"]]}}}).json()
    assert len(runs) == 1, runs  # the one the click made
    run_id = runs[0]["id"]

    deadline = time.monotonic() + 600
    while (run := api_call(ui["api"], "GET", f"/flow_runs/{run_id}").json())["state"]["type"] not in {
            "COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
        assert time.monotonic() < deadline, f"run {run_id} still {run['state']['type']} after 600 s"
        time.sleep(3)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["parameters"]["matrix_file"] == str(matrix_file)  # what was typed is what ran
    folder = next((tmp / "artifacts").glob(f"*_matrix_{run_id[:8]}"))
    verify = subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(folder)], capture_output=True,
                            text=True, cwd=REPO, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr

    # The run's page, its artifacts tab: the matrix report is there.
    browser.get(f"{ui['url']}/runs/flow-run/{run_id}")
    wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "li.p-tab#artifacts"))).click()
    wait.until(ec.visibility_of_element_located((By.XPATH, "//*[contains(text(), 'matrix-report')]")))
    _shot(browser, tmp, "ui-matrix-run-artifacts.png")
