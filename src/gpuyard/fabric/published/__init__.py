"""Published measurements the fabric model is checked against: training runs and collectives, each with its source."""
