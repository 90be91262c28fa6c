"""The web dashboard (``/ui/`` and ``GET /v1/dashboard``): its series and fault timeline on
plain event lists, the page served without the token and the data only with it, and the page
itself in a real headless Chromium (the distribution's ``chromium`` and ``chromedriver``,
driven by Selenium) over a real cluster of two agents: a running task, a heavier one that
borrows a slot (the planner's decisions), a node killed and back. The browser test writes
its screenshots (PNG) to its tmp dir's ``screenshots``; ``make dashboard-shot`` copies the
last one to ``docs/img/dashboard.png`` (``UNICRON_DASHBOARD_PNG``)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import TRAIN
from unicron.control import dashboard as D
from unicron.control.cluster import Cluster, ClusterSettings
from unicron.control.dashboard import WEB
from unicron.control.lab import LocalCluster
from unicron.control.service import make_app

TOKEN = "dash-token-x1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


# -- the snapshot's parts on plain data ----------------------------------------------------------
def test_series_rates_over_the_last_steps_and_thins_long_logs() -> None:
    steps = [(100.0 + 0.5 * i, i, 5.0 - 0.01 * i) for i in range(2000)]
    s = D.series(steps)
    assert len(s["ts"]) == D.MAX_POINTS and s["step"][0] == 0 and s["step"][-1] == 1999
    assert s["rate"][0] is None and s["rate"][-1] == pytest.approx(2.0)  # 5 steps in 2.5 s
    assert s["loss"][-1] == pytest.approx(5.0 - 19.99)
    short = D.series([(0.0, 0, 1.0), (1.0, 1, None), (1.5, 2, 0.5)])
    assert short["rate"] == [None, 1.0, pytest.approx(4 / 3, rel=1e-3)]
    assert short["loss"] == [1.0, None, 0.5]


def step_ends(first: int, last: int, t0: float) -> list[dict[str, Any]]:
    return [{"event": "step_end", "ts": t0 + k - first, "step": k} for k in range(first, last)]


def test_a_real_node_loss_is_one_timeline_row_dated_by_its_last_heartbeat() -> None:
    events = [
        *step_ends(0, 5, 1.0),  # steps 0..4 at ts 1..5
        {"event": "error_detected", "ts": 8.0, "node": 1, "kind": "heartbeat_lost",
         "severity": 1, "method": "heartbeat", "silent_s": 2.5},
        {"event": "error_detected", "ts": 8.2, "slot": 3, "rank": 3, "node": 0,
         "kind": "exited", "severity": 2, "method": "process"},  # a peer's symptom
        {"event": "action", "ts": 8.3, "node": 1, "action": "exclude"},
        {"event": "transition_end", "ts": 9.0, "rank": 0, "duration_s": 0.7,
         "state_source": "local", "microbatches_reused": 3, "microbatches_recomputed": 5},
        *step_ends(5, 7, 10.0),
    ]  # fmt: skip
    (row,) = D.timeline(events)
    assert row["fault"] == "heartbeat_lost on node 1 (not injected)" and not row["injected"]
    assert row["detected_by"] == "heartbeat" and row["kind"] == "heartbeat_lost"
    assert row["detection_s"] == pytest.approx(2.5)  # last heard at 5.5
    assert row["recovery_s"] == pytest.approx(10.0 - 5.5)  # step 5 at ts 10
    assert (row["reused"], row["recomputed"], row["transition_s"]) == (3, 5, 0.7)
    assert row["actions"] == ["exclude(node 1)"]


def test_an_injected_fault_is_one_row_and_a_later_real_one_another() -> None:
    events = [
        *step_ends(0, 3, 1.0),
        {"event": "fault_injected", "ts": 3.5, "fault": "crash", "rank": 1, "step": 3,
         "spec": "crash:rank=1,step=3"},
        {"event": "error_detected", "ts": 3.6, "slot": 1, "node": 0, "kind": "killed",
         "severity": 2, "method": "process"},
        *step_ends(3, 6, 5.0),
        {"event": "error_detected", "ts": 7.5, "slot": 1, "node": 0, "kind": "killed",
         "severity": 2, "method": "process"},  # after steps: a new, real fault
        {"event": "error_detected", "ts": 7.6, "slot": 2, "node": 1, "kind": "conn_reset",
         "severity": 3, "method": "in_band"},  # SEV3: never a fault of its own
        *step_ends(6, 7, 9.0),
    ]  # fmt: skip
    injected, real = D.timeline(events)
    assert injected["fault"] == "crash:rank=1,step=3" and injected["injected"]
    assert injected["detection_s"] == pytest.approx(0.1)
    assert real["fault"] == "killed on slot 1 (not injected)" and not real["injected"]
    assert real["detection_s"] == 0.0 and real["recovery_s"] == pytest.approx(1.5)


def test_decisions_and_worker_counts_come_from_plan_and_epoch_events() -> None:
    events = [
        {"event": "plan", "ts": 1.0, "epoch": 1, "allocation": {"a": 2}, "reason": "start"},
        {"event": "epoch_begin", "ts": 1.0, "epoch": 1, "members": [0, 1]},
        {"event": "plan", "ts": 2.0, "trigger": "node n1 lost", "allocation": {"a": 1},
         "allocation_before": {"a": 2}, "waf_before": 2.0, "waf_after": 1.0, "reason": "r"},
        {"event": "epoch_begin", "ts": 2.1, "epoch": 2, "members": [0]},
    ]  # fmt: skip
    assert D.workers(events) == {"ts": [1.0, 2.1], "count": [2, 1]}
    first, second = D.decisions(events)
    assert first["by"] == "coordinator" and first["waf_after"] is None
    assert second["by"] == "planner" and second["waf_before"] == 2.0
    assert second["trigger"] == "node n1 lost"


def test_the_page_writes_cluster_text_as_text_never_as_html() -> None:
    """Task names, reasons and notes reach the page through ``textContent``: no script of
    it parses a string as HTML."""
    for path in WEB.glob("*.js"):
        code = path.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in code, (path.name, sink)
    assert "textContent" in (WEB / "dashboard.js").read_text()


# -- the service ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    c = Cluster(tmp_path_factory.mktemp("state"), host="127.0.0.1", settings=ClusterSettings())
    try:
        yield TestClient(make_app(c, TOKEN), raise_server_exceptions=False)
    finally:
        c.close(stop_store=True)


def test_the_page_needs_no_token_and_holds_no_data(api: TestClient) -> None:
    page = api.get("/ui/")
    assert page.status_code == 200 and "dashboard.js" in page.text and TOKEN not in page.text
    assert "script-src" not in page.headers["content-security-policy"]  # default-src 'self'
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["referrer-policy"] == "no-referrer"
    for path in ("/ui/dashboard.js", "/ui/dashboard.css", "/ui/vendor/uPlot.iife.min.js"):
        assert api.get(path).status_code == 200, path
    assert api.get("/ui/../state.db").status_code in (401, 404)  # the door, or no such file
    assert api.get("/ui", follow_redirects=False).status_code in (307, 308)
    assert D.is_page("/ui") and D.is_page("/ui/vendor/uPlot.min.css")
    assert not D.is_page("/uix") and not D.is_page("/v1/dashboard")


def test_the_snapshot_needs_the_token(api: TestClient) -> None:
    assert api.get("/v1/dashboard").status_code == 401
    assert api.get("/v1/dashboard", headers={"Authorization": "Bearer no"}).status_code == 401
    r = api.get("/v1/dashboard", headers=AUTH)
    assert r.status_code == 200 and r.json()["nodes"] == [] and r.json()["tasks"] == []


# -- the page in a real browser --------------------------------------------------------------------
@contextlib.contextmanager
def chromium(shots: Path) -> Iterator[Any]:
    """Headless Chromium under Selenium, with the system's chromedriver named explicitly
    (Selenium never looks for or downloads one)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert CHROMIUM is not None and CHROMEDRIVER is not None
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1360,1560", "--no-first-run", "--disable-extensions",
                f"--user-data-dir={shots.parent / 'chromium-profile'}"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=CHROMEDRIVER, log_output=str(shots.parent / "driver.log"))
    browser = webdriver.Chrome(service=service, options=options)
    try:
        yield browser
    finally:
        browser.quit()


def wait_page(browser: Any, script: str, what: str, timeout_s: float = 60.0) -> None:
    """Until ``script`` (JavaScript returning a boolean) holds on the page."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(browser, timeout_s, poll_frequency=0.2).until(
            lambda b: b.execute_script(script)
        )
    except TimeoutException:
        text = browser.execute_script("return document.body.innerText")
        raise AssertionError(f"the page never showed {what}; it shows:\n{text}") from None


def node_is(name: str, state: str) -> str:
    card = f"document.querySelector('.node[data-node=\"{name}\"]')"
    return f'return {card}?.dataset.state === "{state}"'


def slot_is(node: str, *health: str) -> str:
    """JavaScript: the node's slots are all held, each in one of ``health``."""
    return (
        f"const s = document.querySelectorAll('.node[data-node=\"{node}\"] .slot');"
        f"return s.length > 0 && [...s].every(x => {list(health)!r}.includes(x.dataset.health))"
    )


def job(name: str, steps: int, **more: Any) -> dict[str, Any]:
    return {"name": name, "script": str(TRAIN), "args": ["--steps", str(steps)], **more}


def task_is(name: str, state: str, step: int) -> str:
    """JavaScript: the task's card shows ``state`` and a committed step at or past ``step``."""
    card = f"document.querySelector('.task[data-task=\"{name}\"]')"
    return f'const t = {card}; return t?.dataset.state === "{state}" && +t.dataset.step >= {step}'


@pytest.mark.long
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_the_page_shows_a_running_task_and_a_node_lost_and_back(tmp_path: Path) -> None:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no chromium/chromedriver: apt-get install chromium chromium-driver")
    pytest.importorskip("selenium", reason="selenium is in the dev extra: pip install -e .[dev]")
    from selenium.webdriver.common.by import By

    shots = tmp_path / "screenshots"
    shots.mkdir()
    with LocalCluster(tmp_path / "cluster", hosts=2, slots=1) as c, chromium(shots) as browser:
        c.start_coordinator()
        for host in range(2):
            c.start_agent(host, wait=False)
        c.wait_nodes(2)
        c.submit(job("pretrain", 100_000, weight=1.0, workers={"min": 1, "max": 2}))
        browser.get(f"{c.url}/ui/")
        for token in ("not-the-token", c.token):  # refused: the form comes back with a line
            browser.find_element(By.ID, "token").send_keys(token)
            browser.find_element(By.CSS_SELECTOR, "#login button").click()
            if token != c.token:
                refused = "return document.getElementById('login-error').textContent !== ''"
                wait_page(browser, refused, "the wrong token refused", timeout_s=10)
                assert browser.find_element(By.ID, "login").is_displayed()
        wait_page(browser, task_is("pretrain", "running", 1), "task pretrain running")
        # a heavier task takes a slot (the planner's decision, with its WAF), ends, gives it back
        c.submit(job("finetune", 6, weight=3.0, workers={"min": 1, "max": 1}))
        planned = "return !!document.querySelector('#decisions tr.planner')"
        wait_page(browser, planned, "the planner's decision")
        decision = browser.find_element(By.CSS_SELECTOR, "#decisions tr.planner").text
        assert "task finetune submitted" in decision and "→" in decision, decision
        wait_page(browser, task_is("finetune", "done", 5), "task finetune done")
        for name in ("n0", "n1"):
            wait_page(browser, slot_is(name, "training"), f"{name}'s slot training")
        wait_page(browser, task_is("pretrain", "running", 3), "task pretrain on")
        browser.save_screenshot(str(shots / "1-running.png"))

        host = next(h for h in range(2) if c.node(f"n{h}")["id"] == 1)  # agents raced
        c.kill_agent(host)
        wait_page(browser, node_is(f"n{host}", "lost"), f"node n{host} lost")
        badge = browser.find_element(By.CSS_SELECTOR, f'.node[data-node="n{host}"] .badge')
        assert badge.text == "lost"
        wait_page(browser, slot_is(f"n{host}", "excluded", "down"), "the lost node's slot out")
        browser.save_screenshot(str(shots / "2-node-lost.png"))

        c.start_agent(host)
        wait_page(browser, node_is(f"n{host}", "up"), f"node n{host} back up")
        wait_page(browser, slot_is(f"n{host}", "training"), f"n{host}'s slot training again")
        lost_row = "return !!document.querySelector('#timeline tr[data-kind=\"heartbeat_lost\"]')"
        wait_page(browser, lost_row, "the node loss in the fault timeline")
        row = browser.find_element(By.CSS_SELECTOR, '#timeline tr[data-kind="heartbeat_lost"]')
        assert f"node n{host}" in row.text and "heartbeat" in row.text
        browser.save_screenshot(str(shots / "3-node-back.png"))

        assert c.token not in browser.current_url
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        errors = [e for e in errors if "/v1/dashboard" not in e["message"]]  # the 401 above
        assert not errors, errors  # no script error, no resource refused
        c.client.request("POST", "/v1/tasks/pretrain/cancel")
    assert sorted(p.name for p in shots.glob("*.png")) == [
        "1-running.png", "2-node-lost.png", "3-node-back.png",
    ]  # fmt: skip
    if os.environ.get("UNICRON_DASHBOARD_PNG"):  # make dashboard-shot: the README's picture
        shutil.copyfile(shots / "3-node-back.png", os.environ["UNICRON_DASHBOARD_PNG"])
