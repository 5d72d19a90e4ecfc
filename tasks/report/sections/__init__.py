"""The report's sections, one module per part of the page, in the page's order: summary (the first
screen: what was learned, a line per finding, and the checks of the machinery), method (how a
verdict is reached, where the numbers come from), findings (the forest plot and table, the seeds in
rounds, a section per finding with its claims), history (the changes made after a result was seen),
stages (the data sensitivity, the arms per family, the search, spike and pretraining stages), runs
(the MLflow runs and the arms' page). Each builds :class:`~tasks.report.sections.section.Section`
objects; tasks/report/render.py assembles them and renders the same objects as Markdown and as HTML.
words.py puts findings and claims in words for all of them; checks.py says what a check's outcome is."""
