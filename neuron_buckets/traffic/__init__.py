"""What bucket sets cost on real traffic: traces, padding statistics, the planner, reports."""
