//! `kvbridge.plan(scenario)`: the planner on one scenario in the format
//! `kvbridge plan` reads, the blocks returned as a `(n, 3)` `uint64` numpy
//! array (`src`, `dst`, `len` per row) that owns the planner's own buffer.
//!
//! **Never:** plans anything itself (that is `kvbridge-plan`), or copies
//! the block list on its way to numpy.

use kvbridge_plan::Block;
use kvbridge_plan::canonicalize;
use kvbridge_plan::scenario::{Scenario, plan_scenario};
use numpy::{IntoPyArray, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::errors::{PlanFailure, ToPyErr};

/// The blocks for the scenario JSON `text`, flattened to `src, dst, len`
/// triples; in canonical form (what `kvbridge plan` prints) when
/// `canonical`, else in the planner's emission order.
pub fn plan_text(text: &str, canonical: bool) -> Result<Vec<u64>, PlanFailure> {
    let scenario = Scenario::from_json(text)?;
    let blocks = plan_scenario(&scenario)?;
    let blocks = if canonical {
        canonicalize(&blocks)
    } else {
        blocks
    };
    Ok(flatten(blocks))
}

/// `blocks` as one `u64` buffer, reusing the allocation (`Block` is
/// `repr(C)` and `Pod`: three `u64`s).
fn flatten(blocks: Vec<Block>) -> Vec<u64> {
    bytemuck::allocation::try_cast_vec::<Block, u64>(blocks)
        .unwrap_or_else(|(_, blocks)| blocks.iter().flat_map(|b| [b.src, b.dst, b.len]).collect())
}

/// Plan one chunk described by `scenario` (a JSON string, or a dict that
/// `json.dumps` turns into one) and return its blocks as a `(n, 3)`
/// `uint64` array of `src, dst, len` rows: canonical form (as `kvbridge
/// plan` prints it) by default, the planner's order with `canonical=False`.
/// Raises `ScenarioError` or `PlanError` (both `ValueError`).
#[pyfunction]
#[pyo3(signature = (scenario, *, canonical = true))]
pub fn plan<'py>(
    py: Python<'py>,
    scenario: &Bound<'py, PyAny>,
    canonical: bool,
) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let text: String = if let Ok(s) = scenario.cast::<PyString>() {
        s.to_cow()?.into_owned()
    } else if let Ok(b) = scenario.cast::<PyBytes>() {
        String::from_utf8(b.as_bytes().to_vec()).map_err(|e| {
            crate::errors::ScenarioError::new_err(format!("scenario bytes are not UTF-8: {e}"))
        })?
    } else {
        py.import("json")?
            .call_method1("dumps", (scenario,))?
            .extract()?
    };
    let flat = py
        .detach(|| plan_text(&text, canonical))
        .map_err(ToPyErr::to_py_err)?;
    let rows = flat.len() / 3;
    flat.into_pyarray(py).reshape([rows, 3])
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_plan::scenario::ScenarioResult;

    fn fixture(rel: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(rel);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn flat_blocks_match_the_expected_plan() {
        for name in ["mha_equal_tp", "mha_hetero_tp_gqa_scatter", "swa_state"] {
            let flat = plan_text(&fixture(&format!("plan-examples/{name}.json")), true).unwrap();
            assert_eq!(flat.len() % 3, 0);
            let got = ScenarioResult::Blocks(
                flat.chunks(3)
                    .map(|t| Block::new(t[0], t[1], t[2]))
                    .collect(),
            );
            let want =
                ScenarioResult::from_json(&fixture(&format!("plan-examples/expected/{name}.json")))
                    .unwrap();
            assert!(got.matches(&want), "{name}");
            // Canonical form is sorted; the planner's order holds the same bytes.
            let raw = plan_text(&fixture(&format!("plan-examples/{name}.json")), false).unwrap();
            let sum = |v: &[u64]| v.chunks(3).map(|t| t[2]).sum::<u64>();
            assert_eq!(sum(&raw), sum(&flat));
        }
    }

    #[test]
    fn rejections_and_unreadable_scenarios_are_told_apart() {
        let err = plan_text(&fixture("plan-examples/error_missing_layer.json"), true).unwrap_err();
        assert!(matches!(err, PlanFailure::Rejected(_)), "{err}");
        assert!(!err.to_string().is_empty());
        assert!(matches!(
            plan_text("{", true),
            Err(PlanFailure::Unreadable(_))
        ));
        assert!(matches!(
            plan_text(r#"{"surprise": 1}"#, true),
            Err(PlanFailure::Unreadable(_))
        ));
    }

    #[test]
    fn flatten_keeps_field_order() {
        let v = flatten(vec![Block::new(1, 2, 3), Block::new(4, 5, 6)]);
        assert_eq!(v, [1, 2, 3, 4, 5, 6]);
        assert!(flatten(Vec::new()).is_empty());
    }
}
