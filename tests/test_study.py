"""The study's statistics against Student-t quantiles from a printed table, and its command (resume, refusals,
a failed seed, the table) on a stand-in task that writes summary.json as the demo does."""

import json
import math
import re
from pathlib import Path

import pytest

from amir_verl import run_figures
from amir_verl.study import study, toy_setting
from amir_verl.study.statistics import paired_difference
from tests.support import paired_t_by_hand as by_hand


@pytest.mark.parametrize("grpo, amir", [
    ([0.1, 0.3], [0.2, 0.7]),
    ([0.5, 0.2, 0.9], [0.4, 0.6, 1.0]),
    ([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], [0.15, 0.1, 0.45, 0.4, 0.9, 0.5, 0.75, 0.95]),
])
def test_the_paired_interval_is_the_textbook_one(grpo, amir):
    d = paired_difference(grpo, amir)
    mean, half = by_hand([a - g for g, a in zip(grpo, amir)])
    assert d.seeds == len(grpo) and d.mean == pytest.approx(mean)
    assert d.low == pytest.approx(mean - half, rel=1e-3) and d.high == pytest.approx(mean + half, rel=1e-3)
    assert d.grpo_mean == pytest.approx(sum(grpo) / len(grpo)) and d.amir_mean == pytest.approx(sum(amir) / len(amir))
    assert d.amir_higher == sum(a > g for g, a in zip(grpo, amir)) and d.amir_lower == sum(a < g for g, a in zip(grpo, amir))


def test_missing_values_drop_their_seed_and_degenerate_cases_are_defined():
    d = paired_difference([0.1, None, 0.3, 0.2, float("nan")], [0.2, 0.5, 0.6, None, 0.9])
    mean, half = by_hand([0.1, 0.3])  # seeds 0 and 2 only
    assert d.seeds == 2 and d.mean == pytest.approx(mean) and d.high - d.low == pytest.approx(2 * half, rel=1e-3)
    one = paired_difference([0.1, None], [0.4, 0.2])  # one seed: a difference, no interval
    assert one.seeds == 1 and one.mean == pytest.approx(0.3) and math.isnan(one.low) and math.isnan(one.high)
    none = paired_difference([None, None], [0.1, 0.2])
    assert none.seeds == 0 and math.isnan(none.mean)
    same = paired_difference([0.1, 0.2, 0.3], [0.2, 0.3, 0.4])  # the same difference on every seed
    assert same.low == pytest.approx(0.1) and same.high == pytest.approx(0.1)
    with pytest.raises(ValueError, match="pair them by seed"):
        paired_difference([0.1], [0.1, 0.2])
    with pytest.raises(ValueError, match="confidence"):
        paired_difference([0.1, 0.2], [0.1, 0.2], confidence=95)


FIGURE_VALUES = {  # seed -> (GRPO, AMIR) margin; the other figures follow from it
    0: (-0.30, -0.10), 1: (-0.20, -0.15), 2: (-0.25, 0.05)}


def stand_in_task(calls: list, fail_on: int | None = None) -> study.Task:
    """A task whose 'training' writes summary.json as the demo does: the toy's figures, no Brier."""

    def main(argv):
        folder, seed = argv[argv.index("--workdir") + 1], int(argv[argv.index("--seed") + 1])
        calls.append(seed)
        if seed == fail_on:  # stopped halfway: some of its files are written
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "partial.txt").write_text("the stopped attempt's")
            return 1
        runs = {label: {run_figures.REWARD: 0.1 + seed, run_figures.VALIDATION_ACCURACY: None,
                        run_figures.MARGIN: FIGURE_VALUES[seed][i], run_figures.PAIR_ACCURACY: 0.5,
                        run_figures.BRIER: None} for i, label in enumerate((study.BASE, study.AMIR))}
        Path(folder).mkdir(parents=True, exist_ok=True)
        run_figures.write_summary(Path(folder), "stand-in", runs, {}, {run_figures.BRIER: "no confidence stated"})
        return 0

    return study.Task("toy", "a stand-in", 40, main, study.TASKS["toy"].argv)


def test_the_study_resumes_refuses_other_settings_and_reports_a_failed_seed(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setitem(study.TASKS, "toy", stand_in_task(calls, fail_on=2))
    work = tmp_path / "s"
    args = ["--task", "toy", "--seeds", "3", "--workdir", str(work)]
    assert study.main(args) == 1
    err = capsys.readouterr().err
    assert "seed 2: the toy pair stopped with exit status 1" in err and "resume from seed 2" in err
    assert calls == [0, 1, 2]

    monkeypatch.setitem(study.TASKS, "toy", stand_in_task(calls))
    assert study.main(args) == 0  # seeds 0 and 1 are read, only 2 is trained
    out = capsys.readouterr().out
    assert calls == [0, 1, 2, 2]
    assert "seed 0 (1 of 3): done earlier" in out and "seed 2 AMIR-GRPO: reward 2.100" in out
    # seed 2 was redone from an empty folder, so its wall time (read off its files' times) is this attempt's
    assert "seed 2: removing the files of a stopped attempt" in out and not (work / "seed_2" / "partial.txt").exists()
    mean, half = by_hand([a - g for g, a in FIGURE_VALUES.values()])
    table = (work / "study.md").read_text()
    row = re.search(r"^\| margin \| 3 \| -0.2500 \| -0.0667 \| (\S+) \| \[(\S+), (\S+)\] \| 3 / 0 \|$", table, re.M)
    assert [float(x) for x in row.groups()] == pytest.approx([mean, mean - half, mean + half], abs=2e-4)
    assert "| validation_accuracy | 0 | - | - | - | - | - |" in table
    assert "| pair_accuracy | 3 | 0.5000 | 0.5000 | +0.0000 | [+0.0000, +0.0000] | 0 / 0 |" in table
    assert "- brier: not measured: no confidence stated" in table
    assert "Intervals that exclude 0: none." in table  # margin's interval contains 0 at 3 seeds
    rows = (work / "study.csv").read_text().splitlines()
    assert rows[0] == "seed,run,reward,validation_accuracy,margin,pair_accuracy,brier" and len(rows) == 7
    assert (work / "study.png").stat().st_size > 10_000

    assert study.main([*args, "--steps", "5"]) == 2  # the recorded study ran 40 steps
    assert "other settings (steps 40 -> 5)" in capsys.readouterr().err
    assert json.loads((work / "study.json").read_text())["steps"] == 40
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert study.main(["--task", "toy", "--workdir", str(tmp_path / "other")]) == 2
    assert "holds other files" in capsys.readouterr().err
    assert study.main(["--task", "toy", "--workdir", str(tmp_path / "other" / "notes.txt")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_record_writes_the_table_to_the_docs_results_file(tmp_path, monkeypatch, capsys):
    from amir_verl import results_page

    monkeypatch.setitem(study.TASKS, "toy", stand_in_task([]))
    monkeypatch.setattr(results_page, "DOCS_DIR", tmp_path / "docs")
    args = ["--task", "toy", "--seeds", "2", "--workdir", str(tmp_path / "s"), "--record"]
    assert study.main(args) == 0
    recorded = (tmp_path / "docs" / "results" / "study_toy.md").read_text()
    assert recorded.splitlines()[1].startswith(f"Measured with `python -m amir_verl.study {' '.join(args)}` on ")
    table = (tmp_path / "s" / "study.md").read_text()
    assert recorded.split("\n\n", 1)[1] == table.removeprefix("## ")  # the report, its title a plain line
    assert "table recorded in" in capsys.readouterr().out
    assert (tmp_path / "docs" / "study_toy.png").read_bytes() == (tmp_path / "s" / "study.png").read_bytes()


def test_the_toy_study_trains_each_seeds_pair_with_that_seed_and_the_studys_steps(monkeypatch, tmp_path):
    """The toy task's argv goes through the quickstart's own parser to the main_ppo commands of each seed's pair:
    that seed for the data order, the rollout sampling and the actor's mini-batches, the study's steps, the
    user's overrides last. (What the pair then writes, summary.json's figures, is checked against the runs' own
    metrics by the demo's end-to-end test; the study's table from summary.json by the stand-in tests above.)"""
    from amir_verl.demo import quickstart

    class Trained(Exception):
        pass

    def capture(runs, timeout):
        commands.update(runs)
        raise Trained  # the pair's commands are all this test needs

    monkeypatch.setattr(quickstart, "run_main_ppo_together", capture)
    monkeypatch.setattr(quickstart, "make_assets", lambda workdir: {"model": "M", "train": "T", "test": "V"})
    setting = toy_setting.setting_overrides({"model": "S/model", "train": "S/train", "test": "S/test"})
    for seed in (0, 3):
        commands = {}
        with pytest.raises(Trained):  # the study passes the setting's overrides, then the user's
            study.TASKS["toy"].main(study.TASKS["toy"].argv(tmp_path / f"seed_{seed}", seed, 7,
                                                            [*setting, "trainer.x=1"]))
        assert sorted(commands) == sorted(quickstart.RUNS)
        for run, command in commands.items():
            overrides = command.cmd[command.cmd.index("verl.trainer.main_ppo") + 1:]
            for key in ("data.seed", "actor_rollout_ref.actor.data_loader_seed", "actor_rollout_ref.rollout.seed"):
                assert f"{key}={seed}" in overrides, (seed, run, key)
            assert "trainer.total_training_steps=7" in overrides and overrides[-1] == "trainer.x=1"
            variant = quickstart.RUNS[run][1]
            assert overrides[-len(setting) - 1:-1] == setting  # after the demo's own keys: hydra's last value wins
            assert overrides[-len(setting) - len(variant) - 1:-len(setting) - 1] == variant
            for key in ("actor_rollout_ref.model.path", "data.train_files", "actor_rollout_ref.actor.optim.lr",
                        "trainer.save_freq", "reward.custom_reward_function.path"):
                assert [o for o in overrides if o.startswith(key + "=")][-1] in setting, key
            assert (tmp_path / f"seed_{seed}" / run / "command.txt").read_text().count(f"data.seed={seed}") == 1


def test_the_demo_labels_its_runs_as_the_pipeline_does():
    from amir_verl.demo.quickstart import RUNS

    assert [label for label, _ in RUNS.values()] == [study.BASE, study.AMIR]


def test_bad_arguments_are_refused(capsys):
    for args, message in ((["--task", "toy", "--seeds", "1"], "at least 2"),
                          (["--task", "smollm2", "--steps", "3"], "pipeline size"),
                          (["--task", "toy", "--steps", "0"], "at least 1")):
        with pytest.raises(SystemExit) as exit_info:
            study.main(args)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_smollm2_study_fixes_the_lambda_of_the_amir_run_only(monkeypatch, tmp_path):
    """The study's argv goes through the pipeline's own parser and ``train``: the lr and the filtered training
    prompts to both runs, the fixed lambda to AMIR-GRPO's command alone (after the recipe's keys, so it wins),
    composed into its config."""
    from amir_verl.paper_pipeline import pipeline
    from tests.support import compose_recipe

    commands = {}
    monkeypatch.setattr(pipeline, "run_main_ppo_together", lambda runs, timeout: commands.update(runs))
    for stage in ("prepare_data", "prepare_model", "initial_adapter"):
        monkeypatch.setattr(pipeline, stage, lambda *args: tmp_path / stage)
    filtered = [f"data.train_files={tmp_path / 'filtered.parquet'}", "trainer.total_epochs=2"]
    monkeypatch.setattr(pipeline, "filter_train", lambda *args: filtered)  # tests/test_paper_pipeline.py checks it
    monkeypatch.setattr(pipeline, "merge", lambda *args: (_ for _ in ()).throw(pipeline.PipelineError("stop here")))
    argv = study.TASKS["smollm2"].argv(tmp_path / "seed_0", 0, None, [])
    assert pipeline.main(argv) == 1  # stopped at the merge, after train built both commands
    grpo, amir = (commands[v].cmd for v in ("grpo", "amir_grpo"))
    for override in [*study.SMOLLM2_STUDY_OVERRIDES, *filtered]:  # both runs train on the filtered prompts
        assert override in grpo and override in amir
    amir_only = list(study.SMOLLM2_STUDY_AMIR_OVERRIDES)
    assert amir[-len(amir_only):] == amir_only and not set(amir_only) & set(grpo)
    overrides = amir[amir.index("amir_grpo") + 1:]
    monkeypatch.setenv("AMIR_OUTPUT", str(tmp_path))
    composed = compose_recipe("amir_grpo", "/m", overrides)
    assert (composed.amir.lambda_rule, composed.amir.lambda_init, composed.actor_rollout_ref.actor.optim.lr) == ("fixed", 2.0, 1e-3)
    assert compose_recipe("grpo", "/m", grpo[grpo.index("grpo") + 1:]).get("amir") is None


# ---- the toy study's setting and its probe report --------------------------------------------------------------

def test_the_copy_task_has_the_answer_as_the_prompts_only_digit_and_no_partial_credit():
    rows = toy_setting.validation_rows()
    assert len(rows) == 100 and [r["reward_model"]["ground_truth"][0] for r in rows[:12]] == list("012345678901")
    train = toy_setting.training_rows()
    for row in rows + train:
        question = row["prompt"][0]["content"]
        assert re.findall(r"\d", question) == list(row["reward_model"]["ground_truth"]), question
    assert len({r["prompt"][0]["content"] for r in train}) == len(train)  # no two prompts the same text
    assert rows[3]["prompt"][0]["content"] == "daa te: copy 3" and toy_setting.tag(26 ** 3 - 1) == "zzz"
    score = toy_setting.compute_score
    assert score("s", "7", ["7"])["score"] == 1.0 and score("s", "x7<eos>", "7")["score"] == 1.0
    assert score("s", "3", ["7"])["score"] == 0.0 and score("s", "", ["7"])["score"] == 0.0  # the demo's gives 0.1
    assert score("s", "37", ["7"]) == {"score": 0.0, "acc": 0.0, "pred": "3"}  # the first digit counts


def test_the_cold_start_is_supervised_training_on_the_answer_and_eos(tmp_path):
    """Its first step's loss is the mean over rows and the two target tokens of -log pi, computed one row at a
    time from the untrained model; then the loss falls."""
    import torch

    from amir_verl.demo.toy_task import make_model, make_tokenizer
    from amir_verl.study.probes import prompt_ids

    tokenizer = make_tokenizer(tmp_path / "m")
    model = make_model(tmp_path / "m", tokenizer, seed=0)
    rows = toy_setting.training_rows(8)
    hand = []
    with torch.no_grad():
        for row in rows[:4]:
            prompt = prompt_ids(tokenizer, row["prompt"])
            target = [tokenizer.convert_tokens_to_ids(row["reward_model"]["ground_truth"][0]), tokenizer.eos_token_id]
            log_probs = torch.log_softmax(model(input_ids=torch.tensor([prompt + target])).logits[0], -1)
            hand += [-float(log_probs[len(prompt) - 1 + k, t]) for k, t in enumerate(target)]
    torch.manual_seed(0)
    losses = toy_setting.cold_start(model, tokenizer, rows, steps=30, batch=4, lr=1e-2)
    assert losses[0] == pytest.approx(sum(hand) / len(hand), rel=1e-5)
    assert losses[-1] < losses[0] / 2


def probe_score(margin: float, pair_accuracy: float):
    from amir_verl.study.probes import ProbeScore

    return ProbeScore(10, margin, pair_accuracy, -1.0, -1.0 - margin, 0.5)


PROBE_STEPS = [0, 10, 30]
PROBE_MARGINS = {  # seed -> (GRPO, AMIR) margin at PROBE_STEPS; pair accuracy is margin / 10 + 0.5
    0: ([1.0, 1.2, 1.5], [1.0, 1.4, 1.9]), 1: ([1.0, 1.1, 1.3], [1.0, 1.1, 1.6]), 2: ([1.0, 1.5, 1.4], [1.0, 1.3, 1.8])}
STEP_TIMES = {0: ([9.0, 2.0, 3.0, 2.5], [9.0, 2.2, 3.1, 2.6]), 1: ([8.0, 2.0, 2.0, 4.0], [8.0, 3.0, 2.0, 2.0]),
              2: ([7.0, 1.0, 2.0, 3.0], [7.0, 1.5, 1.5, 9.0])}  # seed -> (GRPO, AMIR) timing_s/step of steps 1-4


def write_metrics(folder: Path, seed: int) -> None:
    """Each run's verl_metrics.jsonl as verl's file logger writes it: validation at steps 0 and 4, four steps."""
    for i, run in enumerate(study.DEMO_RUNS):
        # the second run is not validated before training, as the paper pipeline's: it starts from the first's
        lines = [{"step": 0, "data": {"val-core/src/acc/mean@4": 0.3}}] if i == 0 or seed == 1 else []
        for step, seconds in enumerate(STEP_TIMES[seed][i], start=1):
            data = {"timing_s/step": seconds, "amir/num_pairs": float(step % 2 if i else 0)}
            if step == 4:
                data["val-core/src/acc/mean@4"] = 0.5 + 0.1 * seed + 0.01 * i
            lines.append({"step": step, "data": data})
        (folder / run).mkdir(parents=True, exist_ok=True)
        (folder / run / "verl_metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def probe_task(calls: list) -> study.Task:
    """The stand-in task with the toy's hooks: a shared setting, per-run metrics, and probe scores."""
    from amir_verl.study.probes import PROBE_FILE, ProbeSet

    base = stand_in_task(calls)

    def main(argv):
        assert argv[argv.index("--") + 1] == "setting=1"  # the setting's overrides first
        status = base.main(argv)
        write_metrics(Path(argv[argv.index("--workdir") + 1]), int(argv[argv.index("--seed") + 1]))
        return status

    def score(study_dir, folder, progress):
        if not (folder / PROBE_FILE).exists():  # saved once, as score_demo_pair does
            ProbeSet("toy", "three stand-in prompts", ()).save(folder / PROBE_FILE)
        seed = int(folder.name.removeprefix("seed_"))
        return {run: {step: probe_score(m, m / 10 + 0.5) for step, m in zip(PROBE_STEPS, PROBE_MARGINS[seed][i])}
                for i, run in enumerate(study.DEMO_RUNS)}

    return study.Task("toy", "a stand-in", 4, main, base.argv, prepare=lambda study_dir: ["setting=1"],
                      setting={"k": 1}, score=score)


def table_row(table: str, section: str, first_cell: str) -> list[str]:
    """The cells of the row starting with ``first_cell`` in the table after the line starting with ``section``."""
    part = table[table.index(section):]
    line = next(line for line in part.splitlines() if line.startswith(f"| {first_cell} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_toy_report_compares_the_probe_curves_and_the_step_times_by_hand(tmp_path, monkeypatch, capsys):
    from amir_verl.study.probes import PROBE_FILE, ProbePrompt, ProbeResponse, ProbeSet

    calls = []
    monkeypatch.setitem(study.TASKS, "toy", probe_task(calls))
    work = tmp_path / "s"
    assert study.main(["--task", "toy", "--seeds", "3", "--workdir", str(work)]) == 0
    assert json.loads((work / "study.json").read_text())["setting"] == {"k": 1}
    out = capsys.readouterr().out
    assert "seed 1 GRPO: probe margin +1.000 -> +1.300" in out
    table = (work / "study.md").read_text()
    t975, t80 = 4.303, 1.061  # t(0.975, 2) and t(0.80, 2) from a printed table
    for k, step in enumerate(PROBE_STEPS[1:], start=1):
        differences = [a[k] - g[k] for g, a in PROBE_MARGINS.values()]
        mean, half = by_hand(differences)
        sd = half / t975 * 3 ** 0.5
        cells = table_row(table, "probe margin", str(step))
        assert cells[1] == "3" and float(cells[4]) == pytest.approx(mean, abs=1e-4)
        low, high = (float(x) for x in cells[5].strip("[]").split(","))
        assert (low, high) == pytest.approx((mean - half, mean + half), abs=1e-3)
        assert float(cells[6]) == pytest.approx((t975 + t80) * sd / 3 ** 0.5, rel=1e-3)
        accuracy = table_row(table, "probe pair accuracy", str(step))
        assert float(accuracy[4]) == pytest.approx(mean / 10, abs=1e-4)
    # the mean over training: each seed's difference curve by the trapezoid rule, over the 30 steps spanned
    areas = [(10 * (0 + (a[1] - g[1])) / 2 + 20 * ((a[1] - g[1]) + (a[2] - g[2])) / 2) / 30
             for g, a in PROBE_MARGINS.values()]
    mean, half = by_hand(areas)
    cells = table_row(table, "probe margin", "mean over steps 0-30 (area / 30)")
    assert float(cells[4]) == pytest.approx(mean, abs=1e-4)
    assert [float(x) for x in cells[5].strip("[]").split(",")] == pytest.approx([mean - half, mean + half], abs=1e-3)
    assert table_row(table, "probe margin", "0")[4:6] == ["+0.0000", "[+0.0000, +0.0000]"]  # the shared start
    # per seed: validation accuracy first -> last, AMIR's steps with pairs, median step time over steps 2-4
    for seed, (grpo, amir) in STEP_TIMES.items():
        cells = table_row(table, "Per seed", str(seed))
        ratio = sorted(amir[1:])[1] / sorted(grpo[1:])[1]
        assert cells[1] == f"0.300 -> {0.5 + 0.1 * seed:.3f}" and cells[3] == "2 of 4"
        assert cells[2] == f"0.300 -> {0.5 + 0.1 * seed + 0.01:.3f}"  # the shared start, validated or not
        assert float(cells[6]) == pytest.approx(ratio, abs=1e-3)
    ratios = sorted(sorted(a[1:])[1] / sorted(g[1:])[1] for g, a in STEP_TIMES.values())
    assert f"median {ratios[1]:.3f}, range {ratios[0]:.3f} to {ratios[2]:.3f}" in table
    assert "Probe set (the same for both runs of every seed: three stand-in prompts)" in table
    rows = (work / "study_probes.csv").read_text().splitlines()
    assert rows[0].startswith("seed,run,step,prompts,margin") and len(rows) == 1 + 3 * 2 * 3
    assert (work / "study.png").stat().st_size > 10_000 and (work / "study_figures.png").stat().st_size > 10_000
    # resumed: nothing is trained again, the same report
    assert study.main(["--task", "toy", "--seeds", "3", "--workdir", str(work)]) == 0
    assert calls == [0, 1, 2] and (work / "study.md").read_text() == table
    other = (ProbePrompt("p", (1,), (ProbeResponse((2,), True), ProbeResponse((3,), False))),)
    ProbeSet("toy", "another probe set", other).save(work / "seed_1" / PROBE_FILE)
    assert study.main(["--task", "toy", "--seeds", "3", "--workdir", str(work)]) == 1
    assert "the seeds were scored on different probe sets" in capsys.readouterr().err


def test_validation_curves_read_each_dump_by_hand(tmp_path):
    """The incorrect responses' length (whitespace words under a word tokenizer) and the Brier score over the
    responses that state a confidence, per dumped step, from dumps written by verl's own writer."""
    from tests.support import verl_dump, word_tokenizer

    tokenizer = word_tokenizer(tmp_path / "tok")
    folder = tmp_path / "validation"

    def line(problem, output, acc, confidence, k):
        return {"input": f"q{problem}", "output": output, "score": float(acc), "acc": acc, "confidence": confidence,
                "problem_id": str(problem), "data_source": "openai/gsm8k", "uid": f"u{problem}_{k}_0"}

    verl_dump(folder, 0, [line(1, "a b c", 0, 0.9, 0), line(1, "a b", 1, 0.5, 1), line(2, "a b c d e", 0, -1, 2)])
    verl_dump(folder, 2, [line(1, "a", 1, 0.8, 0), line(2, "b c", 1, -1, 1)])
    (folder / "notes.jsonl").write_text("")  # not a step's dump: left alone
    curves = study.validation_curves(folder, tokenizer)
    assert list(curves) == [0, 2]
    assert curves[0][study.INCORRECT_TOKENS] == pytest.approx((3 + 5) / 2)
    assert curves[0][study.BRIER] == pytest.approx(((0 - 0.9) ** 2 + (1 - 0.5) ** 2) / 2)  # -1: no confidence
    assert math.isnan(curves[2][study.INCORRECT_TOKENS]) and curves[2][study.BRIER] == pytest.approx(0.04)


def test_a_seeds_wall_time_is_read_off_its_files(tmp_path, monkeypatch):
    import os

    for seed, (first, last) in {0: (1000.0, 1250.0), 1: (2000.0, 2100.0)}.items():
        folder = study.seed_dir(tmp_path, seed)
        (folder / "data").mkdir(parents=True)
        for name, when in (("data/a.parquet", first), ("b.json", (first + last) / 2), ("probe_scores.json", last)):
            (folder / name).write_text("x")
            os.utime(folder / name, (when, when))
    assert study.seed_wall_time(study.seed_dir(tmp_path, 0)) == 250.0
    os.utime(study.seed_dir(tmp_path, 0) / "b.json")  # copied elsewhere: new times; the measured figure stays
    assert study.seed_wall_time(study.seed_dir(tmp_path, 0)) == 250.0
    monkeypatch.setattr(study, "available_cores", lambda: 2)
    assert study.wall_time_line(tmp_path, [0, 1]).endswith("350 s for the 2 seeds, 100 to 250 s a seed, on 2 cores.")
