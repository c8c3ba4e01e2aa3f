"""The acceptance suite's reports and command line (kubevirt_spawner/acceptance): the JSON is the
source of truth, HTML and Markdown render it with everything a guest or the cluster said escaped,
and bad input is one sentence and exit status 2 before anything is asked of a hub."""

from __future__ import annotations

import json

import pytest

from kubevirt_spawner import cli
from kubevirt_spawner.acceptance.report import (
    FAIL,
    PASS,
    SKIP,
    Record,
    from_json,
    render,
    to_html,
    to_json,
    to_markdown,
)

HOSTILE = '<img src=x onerror="alert(1)"> | **bold**\nsecond line'
RECORDS = [
    Record("host", "node-pools", PASS, "3 node(s) are in the workstation pools.", {"pool nodes": ["a", "b"]}, 0.4),
    Record("persistence", "files-kept", FAIL, f"Lost: {HOSTILE}", {"files": 5, "guest said": HOSTILE}, 12.0),
    Record("storage", "node-loss-fenced-cold-start", SKIP, "Give --destructive --node NODE.", {}, 0.0),
]
META = {"hub_url": "https://hub.example.org/", "user": "kvs-acceptance", "started": "2026-12-04T22:00:00+00:00",
        "duration": 612.3, "version": "0.1.0"}


def test_the_json_holds_every_record_and_reads_back():
    data = json.loads(to_json(RECORDS, META))
    assert data["summary"] == {"PASS": 1, "FAIL": 1, "SKIP": 1}
    assert [e["name"] for e in data["experiments"]] == ["node-pools", "files-kept", "node-loss-fenced-cold-start"]
    assert set(data["experiments"][1]) == {"section", "name", "result", "sentence", "figures", "duration"}
    records, meta = from_json(to_json(RECORDS, META))
    assert records == RECORDS and meta == META


def test_the_html_page_has_a_summary_a_section_per_part_and_escapes_what_it_was_told():
    page = to_html(RECORDS, META)
    assert "<img" not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page
    assert page.index("<h2>Summary</h2>") < page.index("<h2>Host and scheduling</h2>") < \
        page.index("<h2>Persistence semantics</h2>") < page.index("<h2>Storage and recovery</h2>")
    assert "Security and product experience" not in page  # (no record of it: no section)
    assert '<td class="FAIL">FAIL</td>' in page and "1 passed, 1 failed, 1 skipped" in page


def test_the_markdown_table_keeps_one_row_per_experiment():
    text = to_markdown(RECORDS, META)
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| result", "| ---"))]
    assert len(rows) == 3
    assert all(row.count(" | ") == 4 for row in rows), rows  # (a pipe or a line break from a guest is escaped)
    assert "<img" not in text
    # quotes stay quotes (no entity whose # the Markdown escape then breaks)
    said = to_markdown([Record("host", "placement", PASS, "The user's machine runs on \"a\".", {}, 0.1)], META)
    assert "The user's machine runs on \"a\"." in said and "&" not in said


@pytest.mark.parametrize("path", ["report.txt", "report", "report.html.bak"])
def test_a_report_name_without_a_format_is_refused(path):
    with pytest.raises(ValueError, match="name a .json, .html or .md file"):
        render(path, RECORDS, META)


@pytest.mark.parametrize("argv, sentence", [
    (["--only", "host,network"], "--only host,network: unknown section network; choose from host, persistence"),
    (["--report", "out.pdf"], "--report out.pdf: name a .json, .html or .md file."),
    (["--report", "/nonexistent-dir/acceptance.json"], "--report /nonexistent-dir/acceptance.json: cannot write it "
                                                        "(No such file or directory)."),
    (["--destructive"], "--destructive needs --node NODE"),
    (["--clones", "-1"], "--clones is 0 or more."),
    (["--hub-url", "http://127.0.0.1:9"], "Cannot reach the hub at http://127.0.0.1:9/"),
])
def test_bad_input_is_one_sentence_and_status_2(argv, sentence, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "t")
    monkeypatch.setenv("JUPYTERHUB_URL", "http://127.0.0.1:9")
    assert cli.main(["acceptance", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kubevirt-spawner acceptance: ") and sentence in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_printed_line_carries_no_terminal_escapes_from_a_guest():
    line = Record("persistence", "files-kept", FAIL, "Lost: \x1b[2J\x1b]0;owned\x07 gone\nnext").line()
    assert "\x1b" not in line and "\n" not in line and line.startswith("FAIL persistence/files-kept: Lost: ")
