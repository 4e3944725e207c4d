"""The terminal answer and the self-contained HTML reports: page model, figures, the advise and training
pages."""
