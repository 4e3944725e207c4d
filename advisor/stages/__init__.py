"""The stages of `sdzero advise`, in the order advisor.stages.advise.run_advise composes them; each takes the typed
outputs of those before it and returns its own:

    inputs     read_inputs:          AdviseRequest -> AdviseInputs   options checked, base config, device, grid
    measure    measure_hardware:     -> HardwareFigures              collectives benchmark, networks, memory
               measure_trials:       -> MeasuredTrials               the search's trials, then the check trials
    fit        fit:                  -> FittedModels                 memory and step-time models, every trial
    predict    predict:              -> Predictions                  every candidate at every node count
    recommend  recommend_config:     -> Choice                       the config, its node count and LR
               write_recommendation: -> recommendation.json's payload
    report     write_report:         -> ReportOutcome                report.html
"""
