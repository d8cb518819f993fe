#![deny(unsafe_code)]
