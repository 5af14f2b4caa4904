"""Published measurements the fabric model is checked against (training runs, collectives), with sources."""
