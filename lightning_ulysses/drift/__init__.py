"""The versions the suite passed on, and the run-time check of the private touch points when others are installed."""
