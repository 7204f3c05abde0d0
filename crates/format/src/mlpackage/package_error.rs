//! What can be wrong with a package, naming the file.

use std::path::PathBuf;

/// What can be wrong with a package.
#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: bad Manifest.json: {msg}", path.display())]
    Manifest { path: PathBuf, msg: String },
    #[error("{}: not a valid Core ML model protobuf: {source}", path.display())]
    Protobuf {
        path: PathBuf,
        #[source]
        source: prost::DecodeError,
    },
    #[error("{}: {msg}", path.display())]
    Model { path: PathBuf, msg: String },
    #[error("{}: blob at offset {offset}: {msg}", path.display())]
    Blob {
        path: PathBuf,
        offset: u64,
        msg: String,
    },
    #[error("{}: weight file name {file_name:?} escapes the package (absolute, `..` or a symlink out)", path.display())]
    EscapingFile { path: PathBuf, file_name: String },
    #[error("{what}: {msg}")]
    Value { what: String, msg: String },
}
