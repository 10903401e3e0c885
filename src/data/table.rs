//! Datasets stored as Arrow tables: Parquet files (what the hub serves) and the Arrow IPC
//! streams `datasets.save_to_disk` writes. Each row becomes the JSON object it would be in
//! a JSONL file, so records of every container go through the same readers (alpaca,
//! sharegpt, tokenized) with the same checks and messages.
//!
//! Text, numbers, booleans, lists, structs and dictionary-encoded columns convert; other
//! types (binary, temporal, decimal: images and timestamps, never text a template reads)
//! become `null`, which a reader that needs the column reports as missing.

use std::fs::File;
use std::path::Path;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type,
    UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;
use serde_json::{Map, Number, Value};

use crate::error::{Error, Result};

/// Every row of a Parquet file as JSON text.
pub fn parquet_rows(path: &Path) -> Result<Vec<String>> {
    let bad = |e: &dyn std::fmt::Display| Error::DatasetFile {
        path: path.into(),
        msg: format!("not a readable Parquet file: {e}"),
    };
    crate::bounded::check_file(path, crate::bounded::data_bound(), super::files::DATA_FILE)?;
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|b| b.build())
        .map_err(|e| bad(&e))?;
    let mut rows = Vec::new();
    for batch in reader {
        crate::cancel::check(crate::cancel::DATA)?;
        batch_rows(&batch.map_err(|e| bad(&e))?, &mut rows);
    }
    Ok(rows)
}

/// Every row of an Arrow IPC stream file (`data-00000-of-00001.arrow`) as JSON text.
pub fn arrow_rows(path: &Path) -> Result<Vec<String>> {
    let bad = |e: &dyn std::fmt::Display| Error::DatasetFile {
        path: path.into(),
        msg: format!("not a readable Arrow IPC stream: {e}"),
    };
    crate::bounded::check_file(path, crate::bounded::data_bound(), super::files::DATA_FILE)?;
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let reader =
        arrow_ipc::reader::StreamReader::try_new_buffered(file, None).map_err(|e| bad(&e))?;
    let mut rows = Vec::new();
    for batch in reader {
        crate::cancel::check(crate::cancel::DATA)?;
        batch_rows(&batch.map_err(|e| bad(&e))?, &mut rows);
    }
    Ok(rows)
}

fn batch_rows(batch: &RecordBatch, out: &mut Vec<String>) {
    let schema = batch.schema();
    for i in 0..batch.num_rows() {
        let obj: Map<String, Value> = schema
            .fields()
            .iter()
            .zip(batch.columns())
            .map(|(f, col)| (f.name().clone(), value(col.as_ref(), i)))
            .collect();
        out.push(Value::Object(obj).to_string());
    }
}

/// Element `i` of `a` as JSON.
fn value(a: &dyn Array, i: usize) -> Value {
    if a.is_null(i) {
        return Value::Null;
    }
    macro_rules! int {
        ($t:ty) => {
            Value::from(a.as_primitive::<$t>().value(i))
        };
    }
    let float = |x: f64| Number::from_f64(x).map_or(Value::Null, Value::Number);
    let list =
        |items: &dyn Array| Value::Array((0..items.len()).map(|k| value(items, k)).collect());
    match a.data_type() {
        DataType::Boolean => Value::Bool(a.as_boolean().value(i)),
        DataType::Int8 => int!(Int8Type),
        DataType::Int16 => int!(Int16Type),
        DataType::Int32 => int!(Int32Type),
        DataType::Int64 => int!(Int64Type),
        DataType::UInt8 => int!(UInt8Type),
        DataType::UInt16 => int!(UInt16Type),
        DataType::UInt32 => int!(UInt32Type),
        DataType::UInt64 => int!(UInt64Type),
        DataType::Float16 => float(a.as_primitive::<Float16Type>().value(i).to_f64()),
        DataType::Float32 => float(a.as_primitive::<Float32Type>().value(i) as f64),
        DataType::Float64 => float(a.as_primitive::<Float64Type>().value(i)),
        DataType::Utf8 => Value::from(a.as_string::<i32>().value(i)),
        DataType::LargeUtf8 => Value::from(a.as_string::<i64>().value(i)),
        DataType::Utf8View => Value::from(a.as_string_view().value(i)),
        DataType::List(_) => list(a.as_list::<i32>().value(i).as_ref()),
        DataType::LargeList(_) => list(a.as_list::<i64>().value(i).as_ref()),
        DataType::FixedSizeList(..) => list(a.as_fixed_size_list().value(i).as_ref()),
        DataType::Struct(fields) => Value::Object(
            fields
                .iter()
                .zip(a.as_struct().columns())
                .map(|(f, col)| (f.name().clone(), value(col.as_ref(), i)))
                .collect(),
        ),
        DataType::Dictionary(..) => {
            let d = a.as_any_dictionary();
            match value(d.keys(), i).as_u64() {
                Some(k) if (k as usize) < d.values().len() => {
                    value(d.values().as_ref(), k as usize)
                }
                _ => Value::Null,
            }
        }
        _ => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::types::Int32Type;
    use arrow_array::{ArrayRef, DictionaryArray, Float64Array, Int64Array, StringArray};
    use serde_json::json;

    use super::*;

    #[test]
    fn rows_become_the_json_objects_they_hold() {
        let batch = RecordBatch::try_from_iter([
            (
                "s",
                Arc::new(StringArray::from(vec![Some("x"), None])) as ArrayRef,
            ),
            (
                "d",
                Arc::new(DictionaryArray::<Int32Type>::from_iter(["a", "b"])) as ArrayRef,
            ),
            ("n", Arc::new(Int64Array::from(vec![1, -2])) as ArrayRef),
            (
                "f",
                Arc::new(Float64Array::from(vec![0.5, f64::NAN])) as ArrayRef,
            ),
        ])
        .unwrap();
        let mut rows = Vec::new();
        batch_rows(&batch, &mut rows);
        let rows: Vec<Value> = rows
            .iter()
            .map(|r| serde_json::from_str(r).unwrap())
            .collect();
        assert_eq!(
            rows,
            [
                json!({"s": "x", "d": "a", "n": 1, "f": 0.5}),
                json!({"s": null, "d": "b", "n": -2, "f": null})
            ]
        );
    }
}
