"""User and server names to Kubernetes names: valid names stay, nothing ever collides."""

import itertools

import pytest

from kubevirt_spawner import names

TRICKY = ["alice", "Alice", "ALICE", "a.b", "a-b", "a_b", "a--b", "a---b", "a-b---90827a2e", "ålice", "алиса",
          "日本語", "😀", "x" * 200, "x" * 201, "1alice", "-alice", "alice-", "", "a@b.com", "a b", "a/b"]


def test_valid_names_stay_as_they_are():
    for name in ["alice", "a-b", "bob2", "x" * 30]:
        assert names.safe_slug(name) == name


@pytest.mark.parametrize("raw", TRICKY)
def test_every_slug_is_a_dns_label_and_a_label_value(raw):
    slug = names.safe_slug(raw)
    assert names.is_dns1035_label(slug) and len(slug) <= names.USER_SLUG_MAX
    assert names.safe_slug(raw) == slug  # stable


def test_distinct_user_names_never_share_a_slug():
    slugs = {names.safe_slug(n) for n in TRICKY}
    assert len(slugs) == len(set(TRICKY))
    assert names.safe_slug("Alice") != names.safe_slug("alice")
    assert names.safe_slug("a.b") != names.safe_slug("a-b")
    assert names.safe_slug("a--b") != names.safe_slug("a-b")


def test_user_server_pairs_never_collide_with_each_other_or_with_users():
    servers = ["", "gpu", "b", "GPU", "a--b", "x" * 60, "日本"]
    keys = {}
    for user, server in itertools.product(TRICKY, servers):
        slug = names.workstation_slug(user, server)
        assert names.is_dns1035_label(slug) and len(slug) <= names.WORKSTATION_SLUG_MAX, slug
        assert keys.setdefault(slug, (user, server)) == (user, server), f"{slug} collides"
    # user "a" with server "b" is not user "a--b" (nor "a-b")
    assert names.workstation_slug("a", "b") == "a--b"
    assert names.workstation_slug("a--b") != "a--b"
    assert names.workstation_slug("alice", "gpu") == "alice--gpu"


def test_object_names_from_slugs_fit_kubernetes_limits():
    for raw in TRICKY:
        slug = names.workstation_slug(raw, "y" * 100)
        for template in ("{user_server}-workstation", "{user_server}-rootdisk", "notebook-{user}"):
            assert names.is_dns1123_label(template.format(user_server=slug, user=names.safe_slug(raw)))


def test_a_bad_template_names_the_setting():
    with pytest.raises(ValueError, match=r"KubeVirtSpawner.vm_name_template = '\{nope\}-vm'"):
        names.render("{nope}-vm", "KubeVirtSpawner.vm_name_template", user="a", server="", user_server="a")
    with pytest.raises(ValueError, match="DNS-1035"):
        names.render("1-{user}", "KubeVirtSpawner.service_name_template", service=True, user="a", server="",
                     user_server="a")
    with pytest.raises(ValueError, match="63 characters"):
        names.render("{user}-" + "z" * 70, "t", user="a", server="", user_server="a")


def test_a_hashed_slug_carries_80_bits():
    """Issue 30, item 2: a 32-bit hash is hours of one CPU to collide; 80 bits is beyond anyone."""
    for raw in ("Alice", "a@b.com", "x" * 200):
        stem, digest = names.safe_slug(raw).split("---")
        assert len(digest) * 5 >= 80 and set(digest) <= set("abcdefghijklmnopqrstuvwxyz234567")
    stem, digest = names.workstation_slug("Alice Smith", "a server name far too long to join").split("---")
    assert len(digest) * 5 >= 80


def test_printable_escapes_what_could_forge_or_hide_a_log_line():
    assert names.printable("ålice 日本") == "ålice 日本"  # printable text stays as it is
    assert names.printable("a\nb\rc\x1b[2Jd\u2028e\tf") == "a\\nb\\rc\\x1b[2Jd\\u2028e\\tf"
    assert names.printable_args(("a\nb", 3, 2.5, None)) == ("a\\nb", 3, 2.5, None)
