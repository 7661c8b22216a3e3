//! The manager's state file (`<root>/state.json`), as `State::from_bytes` reads it at start.
//! Properties: no panic; every refusal is one line (the manager sets the file aside with that
//! line); an accepted state, saved again, reads back the same.

#![no_main]

use std::path::Path;

use gpu_mps_fuzz::assert_one_line;
use gpu_mps_manager::state::State;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("/run/gpu-mps/state.json");
    let state = match State::from_bytes(data, path) {
        Ok(state) => state,
        Err(e) => {
            assert_one_line(&e);
            return;
        }
    };
    let saved = serde_json::to_vec_pretty(&state).expect("a state serializes");
    match State::from_bytes(&saved, path) {
        Ok(read) => assert_eq!(read, state, "a saved state reads back otherwise"),
        Err(e) => panic!("a saved state is refused: {e}"),
    }
});
