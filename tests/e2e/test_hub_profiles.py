"""Profiles as Zero-to-JupyterHub admins write them (KubeSpawner 7.1's profile_list: a dict of
profiles, profile_options with choices and an unlisted_choice, kubespawner/spawner.py), through
the real hub's spawn form and its REST API, a profile limited to a JupyterHub group, and the
admin's own hook and extra spec on the VM (issue 26).
"""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
import requests
from conftest import SERVICE_API, Cluster, Hub, hub_with_service

from kubevirt_spawner.demo import DEMO_PASSWORD

from simtools import site_policy, wait_for

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "profiles"
EXTRA = """
c.KubeVirtSpawner.start_timeout = 60
c.KubeVirtSpawner.clone_stall_timeout = 30
c.JupyterHub.load_groups = {"gpu-users": {"users": ["gwen"]}}


def modify_vm(spawner, vm):
    vm["metadata"]["annotations"]["example.org/started-by"] = spawner.user.name
    if spawner.user.name == "ivan":  # a typo KubeVirt's schema has no field for
        vm["spec"]["template"]["spec"]["domain"]["cpuu"] = {"cores": 2}
    return vm


c.KubeVirtSpawner.modify_vm_hook = modify_vm
# (the site's own taint beside the demo cluster's pool taint: the list replaces the profiles')
c.KubeVirtSpawner.extra_vm_template_spec = {
    "tolerations": [{"key": "example.org/workstations", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "workload.example.com/kubevirt", "operator": "Exists", "effect": "NoSchedule"}]}
c.KubeVirtSpawner.profile_list = {
    "a-compute": {
        "display_name": "Compute", "default": True,
        "kubevirt_override": {"cpu_guarantee": 2, "mem_guarantee": "4G"},
        "profile_options": {
            "size": {"display_name": "Size", "choices": {
                "small": {"display_name": "2 CPUs, 4 GiB"},
                "large": {"display_name": "4 CPUs, 8 GiB, 80 GiB disk",
                          "kubevirt_override": {"cpu_guarantee": 4, "mem_guarantee": "8G",
                                                "root_disk_size": "80Gi"}}}},
            "project": {"display_name": "Project", "choices": {"none": {"display_name": "None"}},
                        "unlisted_choice": {
                            "enabled": True, "display_name": "Project code",
                            "validation_regex": "^[a-z][a-z0-9-]{1,20}$",
                            "validation_message": "A project code: lowercase letters, digits and -.",
                            "kubevirt_override": {"extra_labels": {"example.org/project": "{value}"}}}},
        },
    },
    "b-gpu": {
        "display_name": "GPU", "allowed_groups": ["gpu-users"],
        "kubevirt_override": {"gpus": {"nvidia.com/A100-PCIE-40GB": 1}},
    },
}
"""


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    # This site's labels and taint, listed for the hub's admission policy as deploy/README asks
    # (the hub applies the default policy when it starts; the site's replaces it)
    for started in hub_with_service(e2e_sim, tmp_path_factory, EXTRA):
        with site_policy(e2e_sim, VM_EXTRA_LABEL_PREFIXES="example.org/",
                         VM_EXTRA_TOLERATION_KEYS="example.org/workstations"):
            yield started


class FormFields(HTMLParser):
    """What a browser without script posts from a form: each select's selected option (the first
    when none is), each input's value, each checked radio."""

    def __init__(self, html: str):
        super().__init__()
        self.fields: dict[str, str] = {}
        self._select: str | None = None
        self._first = True
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "select":
            self._select, self._first = a.get("name"), True
        elif tag == "option" and self._select:
            if self._first or "selected" in a:
                self.fields[self._select] = a.get("value", "")
            self._first = False
        elif tag == "input" and a.get("name") and (a.get("type") != "radio" or "checked" in a):
            self.fields[a["name"]] = a.get("value") or ""

    def handle_endtag(self, tag):
        if tag == "select":
            self._select = None


def log_in(hub: Hub, user: str) -> requests.Session:
    web = requests.Session()
    web.get(f"{hub.url}/hub/login", timeout=30)
    ok = web.post(f"{hub.url}/hub/login", data={"username": user, "password": DEMO_PASSWORD,
                                                "_xsrf": web.cookies.get("_xsrf")}, timeout=30, allow_redirects=False)
    assert ok.status_code == 302, ok.text
    return web


def template(cluster: Cluster, user: str) -> dict:
    return cluster.vm(f"notebook-{user}", f"{user}-workstation")


def test_choices_from_the_spawn_form_reach_the_machine(hub: Hub, cluster: Cluster):
    """The form has KubeSpawner's fields (kubespawner/templates/form.html); what a browser posts
    without script starts the machine with the chosen size and the typed project code."""
    web = log_in(hub, "fern")
    page = web.get(f"{hub.url}/hub/spawn", timeout=30)
    assert page.status_code == 200
    fields = FormFields(page.text).fields
    assert fields["profile"] == "compute"  # the default profile, picked
    assert fields["profile-option-compute--size"] == "small"
    assert "profile-option-compute--project--unlisted-choice" in fields
    assert "gpu" not in fields.get("profile", "") and 'value="gpu"' not in page.text  # not her group's
    fields.update({"profile-option-compute--size": "large", "profile-option-compute--project": "unlisted-choice",
                   "profile-option-compute--project--unlisted-choice": "atlas", "_xsrf": web.cookies.get("_xsrf")})
    started = web.post(f"{hub.url}/hub/spawn", data=fields, timeout=60, allow_redirects=False)
    assert started.status_code == 302, started.text
    hub.wait_ready("fern", timeout=120)
    vm = template(cluster, "fern")
    spec = vm["spec"]["template"]["spec"]
    assert spec["domain"]["resources"]["requests"] == {"cpu": "4", "memory": "8Gi"}
    assert vm["spec"]["template"]["metadata"]["labels"]["example.org/project"] == "atlas"
    annotations = vm["metadata"]["annotations"]
    assert annotations["kubevirt-spawner.io/profile"] == "compute"
    assert json.loads(annotations["kubevirt-spawner.io/profile-options"]) == {
        "project--unlisted-choice": "atlas", "size": "large"}
    # stopped, the form shows her last choices
    hub.stop_server("fern")
    form = FormFields(web.get(f"{hub.url}/hub/spawn", timeout=30).text).fields
    assert form["profile-option-compute--size"] == "large"
    assert form["profile-option-compute--project"] == "unlisted-choice"
    assert form["profile-option-compute--project--unlisted-choice"] == "atlas"


def test_choices_through_the_rest_api_as_kubespawner_reads_them(hub: Hub, cluster: Cluster):
    hub.ensure_user("rita")
    r = hub.api("POST", "/users/rita/server", json={"profile": "compute", "size": "large",
                                                     "project--unlisted-choice": "lhc-run3"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("rita", timeout=120)
    vm = template(cluster, "rita")
    assert vm["spec"]["template"]["spec"]["domain"]["resources"]["requests"] == {"cpu": "4", "memory": "8Gi"}
    assert vm["spec"]["template"]["metadata"]["labels"]["example.org/project"] == "lhc-run3"
    hub.stop_server("rita")
    # the default choices, the next time: the small machine, no project label
    assert hub.api("POST", "/users/rita/server", json={"profile": "compute"}).status_code in (201, 202)
    hub.wait_ready("rita", timeout=120)
    vm = template(cluster, "rita")
    assert vm["spec"]["template"]["spec"]["domain"]["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    assert "example.org/project" not in vm["spec"]["template"]["metadata"]["labels"]
    assert json.loads(vm["metadata"]["annotations"]["kubevirt-spawner.io/profile-options"]) == {
        "project": "none", "size": "small"}
    hub.stop_server("rita")


@pytest.mark.parametrize("body,sentence", [
    ({"profile": "gpu"}, "The profile 'gpu' is not open to eve: its administrator limits it to some users or "
                         "groups. Profiles you may use: compute."),
    ({"profile": "compute", "project--unlisted-choice": "Atlas; rm -rf"},
     "is not accepted: A project code: lowercase letters, digits and -."),
    ({"profile": "compute", "size": "huge"}, "Unknown choice 'huge' for Size (size) in the profile 'compute'. "
                                             "Choose one of: small, large."),
    ({"profile": "compute", "gpus": "8"}, "Unsupported option(s) gpus for the profile 'compute'"),
])
def test_what_a_user_may_not_choose_is_a_sentence_and_makes_nothing(hub: Hub, cluster: Cluster, body, sentence):
    hub.ensure_user("eve")
    r = hub.api("POST", "/users/eve/server", json=body)
    assert r.status_code == 400 and sentence in r.json()["message"], r.text
    assert template(cluster, "eve") is None
    assert cluster.pvcs("notebook-eve") == []


def test_a_groups_profile_is_offered_to_its_members_only(hub: Hub):
    """JupyterHub's groups (c.JupyterHub.load_groups): gwen is in gpu-users, eve is not."""
    gwen = log_in(hub, "gwen").get(f"{hub.url}/hub/spawn", timeout=30).text
    eve = log_in(hub, "eve").get(f"{hub.url}/hub/spawn", timeout=30).text
    assert 'value="gpu"' in gwen and 'value="compute"' in gwen
    assert 'value="gpu"' not in eve and 'value="compute"' in eve


def test_the_workstations_service_resets_with_the_users_choices(hub: Hub, cluster: Cluster):
    """The service acts on a machine from outside the hub's process: it reads the profile and the
    choices the VM records (kubevirt-spawner.io/profile-options), so a reset gives rosa a new
    system disk of her choice's 80Gi, not the profile's default 60Gi."""
    hub.ensure_user("rosa")
    assert hub.api("POST", "/users/rosa/server", json={"profile": "compute", "size": "large"}).status_code in (201, 202)
    hub.wait_ready("rosa", timeout=120)
    hub.stop_server("rosa")
    token = hub.api("POST", "/users/rosa/tokens", json={"note": "test"}).json()["token"]
    service = requests.Session()
    service.headers["Authorization"] = f"token {token}"
    r = service.post(f"{hub.url}{SERVICE_API}/workstations/rosa/reset", json={"confirm": "rosa"}, timeout=120)
    assert r.status_code == 202, r.text

    def finished():
        op = service.get(f"{hub.url}{SERVICE_API}/workstations/rosa", timeout=60).json()["operation"]
        return op if op and op["state"] != "running" else None
    assert wait_for(finished, 180, what="the reset")["state"] == "done"
    disk = next(p for p in cluster.pvcs("notebook-rosa") if p["metadata"]["name"] == "rosa-rootdisk")
    assert disk["spec"]["resources"]["requests"]["storage"] == "80Gi"


def test_the_admins_hook_and_extra_spec_land_in_the_vm_and_a_vm_the_cluster_refuses_makes_nothing(
        hub: Hub, cluster: Cluster):
    """modify_vm_hook (KubeSpawner's modify_pod_hook) and extra_vm_template_spec (its
    extra_pod_config) on the VM; the cluster checks the VM with a dry run before any disk is
    made, so ivan's VM, which the hook gives a field KubeVirt lacks, is a sentence and nothing."""
    hub.ensure_user("hana")
    assert hub.api("POST", "/users/hana/server", json={"profile": "compute"}).status_code in (201, 202)
    hub.wait_ready("hana", timeout=120)
    vm = template(cluster, "hana")
    assert vm["metadata"]["annotations"]["example.org/started-by"] == "hana"
    assert vm["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "example.org/workstations", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "workload.example.com/kubevirt", "operator": "Exists", "effect": "NoSchedule"}]
    hub.stop_server("hana")
    hub.ensure_user("ivan")
    r = hub.api("POST", "/users/ivan/server", json={"profile": "compute"})
    assert r.status_code in (400, 500), r.text
    message = r.json()["message"]
    assert message.startswith("The cluster refuses the machine this hub's settings make for you (strict decoding "
                              'error: unknown field "spec.template.spec.domain.cpuu"), so nothing was created'), message
    assert template(cluster, "ivan") is None and cluster.pvcs("notebook-ivan") == []
    assert cluster.datavolumes("notebook-ivan") == []


def test_the_form_in_a_browser_by_keyboard(hub: Hub, cluster: Cluster, browser):
    """In Chromium: the form's script shows a value field only when its "Other..." is chosen, and
    choosing in a profile's options picks that profile; keyboard alone fills and sends it."""
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    context.set_default_timeout(60_000)
    try:
        page = context.new_page()
        page.goto(f"{hub.url}/hub/login")
        page.fill("#username_input", "gwen")
        page.fill("#password_input", DEMO_PASSWORD)
        page.click("#login_submit")
        page.wait_for_url(lambda url: "/hub/spawn" in url)
        other = page.locator("#profile-option-compute--project--unlisted-choice")
        assert not other.is_visible()
        page.locator("#profile-item-gpu").check()  # gwen may use the GPU profile: shown to her
        size = page.locator("#profile-option-compute--size")
        size.focus()  # (touching the compute profile's option picks the compute profile)
        assert page.locator("#profile-item-compute").is_checked()
        page.keyboard.press("ArrowDown")  # small -> large
        assert size.input_value() == "large"
        project = page.locator("#profile-option-compute--project")
        project.focus()
        page.keyboard.press("ArrowDown")  # None -> Other...
        assert project.input_value() == "unlisted-choice" and other.is_visible()
        other.focus()
        page.keyboard.type("gwen-lab")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "profiles-form.png"))
        with page.expect_navigation():
            page.keyboard.press("Enter")
        hub.wait_ready("gwen", timeout=120)
        vm = template(cluster, "gwen")
        assert vm["spec"]["template"]["metadata"]["labels"]["example.org/project"] == "gwen-lab"
        assert vm["spec"]["template"]["spec"]["domain"]["resources"]["requests"]["cpu"] == "4"
        hub.stop_server("gwen")
    finally:
        context.close()
