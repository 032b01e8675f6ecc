// A hand-written program compiled instead of a derived one. Rank 0 waits for a
// gradient before it sends the activation rank 1 needs to produce it: deadlock.
mpipe::schedule! {
    mod plan {
        program_json = r#"{
          "format": "mpipe-program/1", "ranks": 2, "microbatches": 1,
          "units": [
            {"name": "llm.0", "inputs": [], "home": 0, "trainable": true,
             "cost": {"F": 1.0, "B": 1.0, "W": 1.0}, "act": 1.0},
            {"name": "llm.1", "inputs": ["llm.0"], "home": 1, "trainable": true,
             "cost": {"F": 1.0, "B": 1.0, "W": 1.0}, "act": 1.0}
          ],
          "programs": [
            [ {"op": "F", "unit": "llm.0", "mb": 0},
              {"op": "RECV", "tensor": "grad", "unit": "llm.1", "mb": 0, "peer": 1},
              {"op": "SEND", "tensor": "act", "unit": "llm.0", "mb": 0, "peer": 1},
              {"op": "BW", "unit": "llm.0", "mb": 0} ],
            [ {"op": "RECV", "tensor": "act", "unit": "llm.0", "mb": 0, "peer": 0},
              {"op": "F", "unit": "llm.1", "mb": 0},
              {"op": "BW", "unit": "llm.1", "mb": 0},
              {"op": "SEND", "tensor": "grad", "unit": "llm.1", "mb": 0, "peer": 0} ]
          ]
        }"#;
    }
}

fn main() {}
