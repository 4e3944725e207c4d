"""The typer commands of the advisor (advise, profile, comm, report); advisor.cli composes them."""
