"""``tensorlens rules RUN [--rule SPEC ...]``: run rules over a stored run and print what they find.

A SPEC is a built-in rule's name, optionally with parameters as SageMaker passes them (strings):
``--rule VanishingGradient --rule "UnchangedTensor:collection_names=weights;num_steps=5"``.
Without ``--rule``, the default rules for what the run recorded run; a rule that had nothing to
read says "not evaluated" and why. ``--check`` exits with 1
when a rule fired (for CI); ``--list`` (no RUN needed) names the built-in rules and their
parameters. The logic lives in :func:`tensorlens.rules.offline.rules_command`.
"""

from __future__ import annotations

import click


@click.command(name="rules")
@click.argument("run", required=False, type=click.Path(exists=True, file_okay=True, dir_okay=True))
@click.option("--rule", "rule_specs", multiple=True, metavar="SPEC",
              help="NAME or NAME:key=value;key=value (repeatable). Default: the default rules for what the run recorded.")
@click.option("--start-step", type=click.IntRange(min=0), default=0, show_default=True,
              help="First global step checked (earlier records are not read).")
@click.option("--end-step", type=click.IntRange(min=0), default=None, help="Global step to stop before (default: the end).")
@click.option("--check", is_flag=True, help="Exit with 1 when a rule fired.")
@click.option("--list", "list_rules", is_flag=True, help="List the built-in rules and their parameters, and exit (no RUN needed).")
def command(run: str | None, rule_specs: tuple[str, ...], start_step: int, end_step: int | None, check: bool,
            list_rules: bool) -> None:
    """Check a stored RUN with tensorlens rules (SageMaker Debugger's built-ins and more)."""
    from tensorlens.cli.progress import progress
    from tensorlens.cli.table import printable
    from tensorlens.rules.builtin import BUILTIN_RULES, rule_parameters
    from tensorlens.rules.defaults import default_note
    from tensorlens.rules.offline import command_rules, evaluate, print_findings
    from tensorlens.store.reader import open_run

    if list_rules:
        for name in sorted(BUILTIN_RULES):
            params = ", ".join(rule_parameters(BUILTIN_RULES[name]))
            click.echo(f"{name}{default_note(name)}  parameters: {params}")
        return
    if run is None:
        raise click.UsageError("Missing argument 'RUN' (only --list needs none).")
    if end_step is not None and end_step < start_step:
        raise click.BadParameter(f"{end_step} is before --start-step {start_step}", param_hint="'--end-step'")
    rules = command_rules(rule_specs) if rule_specs else None  # a bad spec fails before anything is read
    with open_run(run) as stored:  # no --rule: the default rules for what the run recorded
        total = sum(1 for k in stored.step_keys() if k.step >= start_step and (end_step is None or k.step < end_step))
        with progress(total, "checking", unit="record") as advance:
            result = evaluate(stored, rules, start_step=start_step, end_step=end_step, on_record=lambda _: advance(1))
    code = print_findings(result.rules, [*result.findings, *result.not_evaluated], echo=lambda line: click.echo(printable(line)))
    if check and code:
        raise SystemExit(code)
