"""`agentgrpo view`: a run folder read as the page's data, the page, its server and command."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from agentgrpo.cli import main
from agentgrpo.reporting import view_data, view_server
from agentgrpo.reporting.plot import COLOURS, line_chart_svg
from agentgrpo.reporting.run_log import episode_file
from agentgrpo.reporting.view import RunView, render_page
from agentgrpo.reporting.view_server import make_server
from rollout import EpisodeRecord, record_line
from tests.support.episodes import COUNTER_TURNS, scripted_episode, tool_call
from tests.support.paths import REPO

BAD_CALL_TURNS = [tool_call("increment", step="four"), "Done."]


def record(episode, reward=1.0, advantage=0.5, rewards=None) -> EpisodeRecord:
    return EpisodeRecord(
        episode=episode,
        rewards={"Counter": reward} if rewards is None else rewards,
        reward=reward,
        advantage=advantage,
        policy_version=0,
    )


def metrics_line(step: int, reward: float, **more: float) -> str:
    entry = {"step": step, "reward": reward, "tools/call_frequency": 2.0, **more}
    return json.dumps(entry) + "\n"


@pytest.fixture
def run_dir(tmp_path, tokenizer):
    """A run folder as a run leaves it: two steps of real records, metrics, a saved tokenizer."""
    good = scripted_episode(tokenizer, COUNTER_TURNS)
    bad = scripted_episode(tokenizer, BAD_CALL_TURNS)
    folder = tmp_path / "run"
    episode_file(folder, 1).parent.mkdir(parents=True)
    episode_file(folder, 1).write_text(record_line(record(good)) + record_line(record(bad, 0.0)))
    episode_file(folder, 2).write_text(record_line(record(good)))
    (folder / "metrics.jsonl").write_text(metrics_line(1, 0.5) + metrics_line(2, 1.0))
    tokenizer.save_pretrained(folder / "model")
    return folder


# ---------------------------------------------------------------------- reading a run folder


def test_an_episode_reads_with_its_tokens_masks_logprobs_calls_and_scores(run_dir, tokenizer):
    good = scripted_episode(tokenizer, COUNTER_TURNS)
    [first, second] = [view_data.episode_view(r) for r in view_data.read_step(run_dir, 1)[0]]
    [row] = first["rows"]
    assert row["prompt_ids"] == good.rows[0].prompt_ids
    assert row["completion_ids"] == good.rows[0].completion_ids
    assert row["loss_mask"] == good.rows[0].loss_mask
    for mask, logprob, sampled in zip(
        row["loss_mask"], row["logprobs"], good.rows[0].sampler_logprobs, strict=True
    ):
        assert logprob == (float(f"{sampled:.4g}") if mask else 0)
    assert [call["name"] for call in first["calls"]] == ["increment", "increment"]
    assert first["calls"][0] == {
        "name": "increment", "arguments": '{"step": 3}', "result": "3", "error": None
    }  # fmt: skip
    assert first["task"] == '{"target": 7}'  # the row's columns, not its prompt
    assert (first["reward"], first["advantage"], first["rewards"]) == (1.0, 0.5, {"Counter": 1.0})
    assert (first["finish"], first["turns"], first["tool_calls"]) == ("stop", 3, 2)
    assert second["tool_errors"] == {"bad_arguments": 1}
    assert second["calls"][0]["error"] == "bad_arguments"


def test_a_step_summary_adds_up_its_episodes(run_dir):
    episodes = [view_data.episode_view(r) for r in view_data.read_step(run_dir, 1)[0]]
    summary = view_data.step_summary(episodes)
    assert summary["episodes"] == 2
    assert summary["reward"] == 0.5 and summary["rewards"] == {"Counter": 0.5}
    assert summary["finish"] == {"stop": 2}
    assert summary["tool_calls"] == 3 and summary["failed_calls"] == 1
    assert summary["tool_errors"] == {"bad_arguments": 1}
    masks = [m for e in episodes for m in e["rows"][0]["loss_mask"]]
    assert (summary["sampled_tokens"], summary["completion_tokens"]) == (sum(masks), len(masks))


def test_a_non_finite_reward_reads_as_its_text(tokenizer, tmp_path):
    folder = tmp_path / "run"
    episode_file(folder, 1).parent.mkdir(parents=True)
    nan_record = record(scripted_episode(tokenizer, COUNTER_TURNS), reward=float("nan"))
    episode_file(folder, 1).write_text(record_line(nan_record))
    [episode] = [view_data.episode_view(r) for r in view_data.read_step(folder, 1)[0]]
    assert episode["reward"] == "nan"
    assert view_data.step_summary([episode])["reward"] is None
    json.dumps(episode, allow_nan=False)  # the page's JSON holds it


def test_a_last_line_still_being_written_is_left_out_not_an_error(run_dir):
    path = episode_file(run_dir, 2)
    whole = path.read_text()
    path.write_text(whole + whole[: len(whole) // 2])  # a second line, cut short
    assert view_data.read_step(run_dir, 2)[1] == []  # nothing skipped: the line is unfinished
    assert len(view_data.read_step(run_dir, 2)[0]) == 1
    path.write_text(whole[: len(whole) // 2])  # only a first line, cut short
    assert view_data.read_step(run_dir, 2) == ([], [])
    assert RunView(run_dir).step(2)["summary"]["episodes"] == 0
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "rew')
    assert [entry["step"] for entry in view_data.read_metrics(run_dir)[0]] == [1, 2]


def test_a_step_line_that_is_not_a_record_is_skipped_with_a_note(run_dir):
    path = episode_file(run_dir, 1)
    [good, bad] = path.read_text().splitlines(keepends=True)
    path.write_text(good + '{"format": 99}\n' + "{oops\n" + bad)
    records, skipped = view_data.read_step(run_dir, 1)
    assert [r.reward for r in records] == [1.0, 0.0]
    assert [note.split(": ", 1)[1][:24] for note in skipped] == [
        "not an episode record (n",
        "not JSON (Expecting prop",
    ]
    assert "step-00001.jsonl, line 2: not an episode record" in skipped[0]
    step = RunView(run_dir).step(1)  # was a ValueError, and a 500 from the server
    assert step["summary"]["episodes"] == 2
    assert step["note"].startswith("2 line(s) of step-00001.jsonl skipped, the episodes show")
    assert RunView(run_dir).step(2)["note"] == ""


def test_a_metrics_line_that_does_not_read_is_skipped_with_a_note(run_dir, tmp_path):
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics_line(1, 0.5) + "{oops\n[1]\n" + metrics_line(2, 1.0))
    entries, skipped = view_data.read_metrics(run_dir)
    assert [entry["step"] for entry in entries] == [1, 2]
    assert [note.split(": ", 1)[1][:16] for note in skipped] == [
        "not JSON (Expect",
        "not a JSON objec",
    ]
    view = RunView(run_dir)
    assert view.index()["metrics"].startswith("2 line(s) of metrics.jsonl skipped")
    assert "metrics.jsonl, line 2: not JSON" in view.index()["metrics"]
    page = view.page(live=False)  # was a ValueError, and a 500 from the server
    assert page.count('<figure class="chart"') == 3


def test_a_folder_without_metrics_shows_its_episodes_and_says_why_there_are_no_charts(
    run_dir, tmp_path
):
    (run_dir / "metrics.jsonl").unlink()  # as a run through the Python API leaves its folder
    assert main(["view", str(run_dir), "--html", str(tmp_path / "page.html")]) == 0  # KeyError
    view = RunView(run_dir)
    index = view.index()
    assert index["metrics"].startswith(f"no metrics.jsonl in {run_dir}")
    assert set(index["charts"]) == {"reward", "tools", "failures"}  # empty, filled once it is
    assert "charts" not in view.index(index["metrics_key"])
    page = view.page(live=False)
    data = json.loads(page.split('id="data">')[1].split("</script>")[0])
    assert sorted(data["step_data"]) == ["1", "2"] and data["metrics"] == index["metrics"]
    (run_dir / "metrics.jsonl").write_text(metrics_line(1, 0.5))
    later = view.index(index["metrics_key"])
    assert "charts" in later and later["metrics"] == ""


def test_a_folder_that_is_not_a_run_says_what_to_give(tmp_path, run_dir):
    with pytest.raises(FileNotFoundError, match="does not exist; give the output folder"):
        view_data.check_run_folder(tmp_path / "nope")
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        view_data.check_run_folder(tmp_path / "file.txt")
    with pytest.raises(ValueError, match=r"neither metrics\.jsonl nor episodes/.*the runs in it: "):
        view_data.check_run_folder(tmp_path)  # holds run_dir
    only_episodes = tmp_path / "early"
    (only_episodes / "episodes").mkdir(parents=True)
    assert view_data.check_run_folder(only_episodes) == only_episodes


def test_charts_show_reward_tool_calls_and_the_failure_kinds_that_happened():
    entries = [
        {"step": 1, "reward": 0.5, "rewards/a/mean": 0.4, "rewards/b/mean": 0.6,
         "tools/call_frequency": 2.0, "turns/mean": 3.0, "tools/failure_frequency": 0.5,
         "tools/failure_frequency/parse": 0.5, "tools/failure_frequency/timeout": 0.0},
        {"step": 2, "reward": 1.0, "rewards/a/mean": 1.0, "rewards/b/mean": 1.0,
         "tools/call_frequency": 1.0, "turns/mean": 2.0, "tools/failure_frequency": 0.0,
         "tools/failure_frequency/parse": 0.0, "tools/failure_frequency/timeout": 0.0},
        {"step": 2, "eval_reward": 0.75},
        {"step": 2, "train_runtime": 10.0},
    ]  # fmt: skip
    series = view_data.chart_series(entries)
    assert series["reward"] == {
        "mean reward": [(1.0, 0.5), (2.0, 1.0)],
        "a": [(1.0, 0.4), (2.0, 1.0)],
        "b": [(1.0, 0.6), (2.0, 1.0)],
        "eval reward": [(2.0, 0.75)],
    }
    assert series["tools"] == {
        "tool calls per episode": [(1.0, 2.0), (2.0, 1.0)],
        "turns per episode": [(1.0, 3.0), (2.0, 2.0)],
    }
    assert list(series["failures"]) == ["failed calls (share)", "parse"]
    one_function = view_data.chart_series([{"step": 1, "reward": 1.0, "rewards/a/mean": 1.0}])
    assert list(one_function["reward"]) == ["mean reward"]  # the same curve twice says nothing


def test_the_tokenizer_is_the_final_models_else_the_latest_checkpoints(run_dir, tokenizer):
    assert view_data.find_tokenizer(run_dir) == run_dir / "model"
    shutil.rmtree(run_dir / "model")
    assert view_data.find_tokenizer(run_dir) is None
    for step in (2, 10):
        tokenizer.save_pretrained(run_dir / f"checkpoint-{step}")
    assert view_data.find_tokenizer(run_dir) == run_dir / "checkpoint-10"


def test_each_token_decodes_on_its_own(run_dir, tokenizer):
    texts = view_data.TokenTexts.load(run_dir / "model")
    ids = tokenizer.encode("<tool_call> 12", add_special_tokens=False)
    assert texts.of(ids) == {str(i): tokenizer.decode([i]) for i in ids}
    assert "".join(texts.of(ids)[str(i)] for i in ids) == "<tool_call> 12"


# ---------------------------------------------------------------------- the page


def test_a_chart_is_inline_svg_text_the_same_for_the_same_series():
    series = {"mean reward": [(1, 0.5), (2, 0.75)], "empty": []}
    svg = line_chart_svg(series, title="reward", x_label="step")
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert ">mean reward<" in svg and ">step<" in svg  # labels are text, not paths
    assert COLOURS[0] in svg
    assert svg == line_chart_svg(series, title="reward", x_label="step")


def test_without_a_tokenizer_the_page_says_so_and_sends_no_texts(run_dir):
    shutil.rmtree(run_dir / "model")
    view = RunView(run_dir)
    assert "no tokenizer saved" in view.index()["tokenizer"]
    assert view.step(1)["tokens"] == {}


def test_a_tokenizer_saved_later_is_picked_up(run_dir, tokenizer):
    shutil.rmtree(run_dir / "model")
    view = RunView(run_dir)
    assert view.step(1)["tokens"] == {}
    tokenizer.save_pretrained(run_dir / "checkpoint-1")
    assert "checkpoint-1" in view.index()["tokenizer"]
    assert view.step(1)["tokens"]


def test_the_index_sends_charts_only_when_the_metrics_changed(run_dir):
    view = RunView(run_dir)
    index = view.index()
    assert [s["step"] for s in index["steps"]] == [1, 2]
    assert set(index["charts"]) == {"reward", "tools", "failures"}
    assert all(svg.startswith("<svg") for svg in index["charts"].values())
    assert "charts" not in view.index(index["metrics_key"])
    with (run_dir / "metrics.jsonl").open("a") as file:
        file.write(metrics_line(3, 0.25))
    assert "charts" in view.index(index["metrics_key"])


def test_a_step_rewritten_by_a_resumed_run_is_read_again(run_dir):
    view = RunView(run_dir)
    before = view.step(1)
    path = episode_file(run_dir, 1)
    path.write_text(path.read_text().splitlines(keepends=True)[0])
    after = view.step(1)
    assert len(before["episodes"]) == 2 and len(after["episodes"]) == 1
    assert before["key"] != after["key"]


def test_a_static_page_holds_every_step_and_the_token_texts(run_dir):
    page = RunView(run_dir).page(live=False)
    data = json.loads(
        page.split('<script type="application/json" id="data">')[1].split("</script>")[0]
    )
    assert data["live"] is False
    assert sorted(data["step_data"]) == ["1", "2"]
    ids = view_data.episode_token_ids(data["step_data"]["1"]["episodes"])
    assert {str(i) for i in ids} <= set(data["tokens"])
    assert page.count('<figure class="chart"') == 3 and "http" not in page.split("<svg")[0]


def test_text_in_the_data_cannot_end_its_script_or_fill_a_marker():
    data = {"live": False, "text": "</script><script>alert(1)</script> {{script}}"}
    page = render_page("run", {}, data)
    assert page.count("</script>") == 2  # the data's element and the page script's
    assert page.count("function el(") == 1
    embedded = page.split('id="data">')[1].split("</script>")[0]
    assert json.loads(embedded) == data


# ---------------------------------------------------------------------- the server


@pytest.fixture
def served(run_dir):
    server = make_server(RunView(run_dir), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_the_server_answers_the_page_the_index_and_each_step(served):
    status, page = get(served + "/")
    assert status == 200 and '"live":true' in page
    status, index = get(served + "/api/index")
    assert status == 200 and [s["step"] for s in json.loads(index)["steps"]] == [1, 2]
    status, step = get(served + "/api/step/2")
    assert status == 200 and len(json.loads(step)["episodes"]) == 1
    status, missing = get(served + "/api/step/7")
    assert status == 404 and "no episodes recorded for step 7" in json.loads(missing)["error"]
    assert get(served + "/nowhere")[0] == 404


def test_the_server_follows_a_run_in_progress(served, run_dir):
    key = json.loads(get(served + "/api/index")[1])["metrics_key"]
    shutil.copy(episode_file(run_dir, 2), episode_file(run_dir, 3))
    with (run_dir / "metrics.jsonl").open("a") as file:
        file.write(metrics_line(3, 0.25))
    index = json.loads(get(served + f"/api/index?metrics={key}")[1])
    assert [s["step"] for s in index["steps"]] == [1, 2, 3]
    assert "charts" in index


def test_the_server_answers_only_requests_for_its_own_host_names(served):
    port = int(served.rsplit(":", 1)[1])

    def status_for(host: str | None) -> int:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.putrequest("GET", "/api/index", skip_host=True)
        if host is not None:
            connection.putheader("Host", host)
        connection.endheaders()
        status = connection.getresponse().status
        connection.close()
        return status

    ours = ["localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "10.0.0.2"]
    assert [status_for(host) for host in ours] == [200] * 5
    # A page of evil.example whose name was rebound to 127.0.0.1 sends its own name.
    theirs = ["evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "", None]
    assert [status_for(host) for host in theirs] == [403] * 5
    assert get(served + "/")[0] == 200  # urllib sends Host 127.0.0.1:PORT


def test_a_step_with_a_line_that_does_not_read_answers_the_rest_and_a_note(served, run_dir):
    path = episode_file(run_dir, 2)
    path.write_text("[1, 2]\n" + path.read_text())
    status, body = get(served + "/api/step/2")
    assert status == 200 and len(json.loads(body)["episodes"]) == 1
    assert "line 1: not a JSON object" in json.loads(body)["note"]


def test_a_client_that_trickles_its_request_is_cut_at_the_request_deadline(served, monkeypatch):
    monkeypatch.setattr(view_server, "REQUEST_TIMEOUT_S", 1.0)
    port = int(served.rsplit(":", 1)[1])
    slow = socket.create_connection(("127.0.0.1", port), timeout=5)
    slow.sendall(b"GET /api/index HTTP/1.1\r\nHost: localhost\r\n")
    started = time.monotonic()
    with pytest.raises(OSError):  # a byte at a time, each well within any per-read timeout
        while time.monotonic() - started < 5:
            slow.sendall(b"X")
            time.sleep(0.1)
    assert time.monotonic() - started < 3
    slow.close()
    assert get(served + "/api/index")[0] == 200


def test_clients_holding_every_connection_leave_the_viewer_up_with_its_threads_bounded(
    run_dir, monkeypatch
):
    monkeypatch.setattr(view_server, "REQUEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(view_server, "MAX_CONNECTIONS", 4)
    server = make_server(RunView(run_dir), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    threads_before = threading.active_count()
    held = [socket.create_connection(server.server_address, timeout=5) for _ in range(40)]
    for connection in held:
        connection.sendall(b"GET /api/index HTTP/1.1\r\nHost: localhost\r\nX-Held: ")
    time.sleep(0.3)
    assert threading.active_count() - threads_before <= 4
    status, _ = get(url + "/api/index")
    assert status == 503  # every slot is held: answered at once, not queued behind them
    time.sleep(1.5)  # the held requests pass their deadline
    assert get(url + "/api/index")[0] == 200
    for connection in held:
        connection.close()
    server.shutdown()
    server.server_close()


# ---------------------------------------------------------------------- the command


def test_view_html_writes_the_page(run_dir, tmp_path, capsys):
    out = tmp_path / "page.html"
    assert main(["view", str(run_dir), "--html", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert out.read_text().startswith("<!DOCTYPE html>")


def test_view_names_what_to_fix(tmp_path, run_dir, capsys):
    assert main(["view", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["view", str(run_dir), "--html", str(tmp_path / "no" / "page.html")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["view", str(run_dir), "--port", "70000"]) == 2
    assert "--port takes 0 to 65535" in capsys.readouterr().err
    assert main(["view", str(run_dir), "--tokenizer", str(tmp_path / "none")]) == 2
    assert "--tokenizer takes a folder" in capsys.readouterr().err


def test_view_on_a_port_in_use_says_so(run_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["view", str(run_dir), "--port", str(port)]) == 2
    assert f"port {port} on 127.0.0.1 is in use; pass --port N" in capsys.readouterr().err


def test_the_page_template_files_are_package_data():
    root = REPO
    pyproject = (root / "pyproject.toml").read_text()
    assert 'agentgrpo = ["reporting/view_page/*"]' in pyproject
    assert {p.name for p in (root / "agentgrpo/reporting/view_page").iterdir()} == {
        "page.html", "page.css", "page.js"
    }  # fmt: skip
