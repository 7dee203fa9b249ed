//! `idemgate`: check filter configurations, derive stored keys, and inspect, list or release
//! keys at the sidecar. See cli/README.md.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use idemgate_cli::{CONFIG_SCHEMA, admin, extract, keys};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "idemgate",
    version,
    about = "Operate idemgate: configurations, keys, the sidecar"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct SidecarArgs {
    /// The sidecar's base URL.
    #[arg(
        long,
        env = "IDEMGATE_SIDECAR_URL",
        default_value = "http://127.0.0.1:9470"
    )]
    sidecar: String,
    /// The sidecar's bearer token (the variable the sidecar itself reads).
    #[arg(skip = std::env::var("IDEMGATE_AUTH_TOKEN").ok())]
    token: Option<String>,
    /// A file whose first line is the token (used when IDEMGATE_AUTH_TOKEN is unset).
    #[arg(long, env = "IDEMGATE_TOKEN_FILE")]
    token_file: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate every idemgate filter configuration in FILEs (raw JSON, an Envoy bootstrap,
    /// an Istio WasmPlugin, an Envoy Gateway policy, or rendered multi-document YAML) with the
    /// filter's own parser; every error is printed with its path, and the exit code is 1.
    Check {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Print the JSON Schema of the filter configuration (for editors).
    Schema,
    /// Print the key a call is stored under at the sidecar.
    Key {
        /// A file holding the configuration (anything `check` reads).
        #[arg(long)]
        config: PathBuf,
        /// The rule's name.
        #[arg(long)]
        rule: String,
        #[arg(long, default_value = "POST")]
        method: String,
        /// The request path with query (for path_param and query_param keys).
        #[arg(long)]
        path: Option<String>,
        /// A scope header as the filter saw it: NAME=VALUE (repeatable).
        #[arg(long = "scope")]
        scope: Vec<String>,
        /// A scope property as the filter saw it: dotted.path=VALUE (repeatable).
        #[arg(long = "property")]
        property: Vec<String>,
        /// The key as the client sent it (a body_pointer key: the field's value, a string's
        /// text or an integer's digits).
        #[arg(long)]
        key: String,
    },
    /// Show one key at the sidecar (state, holder, queue, stored response).
    Inspect {
        key: String,
        #[command(flatten)]
        sidecar: SidecarArgs,
    },
    /// List held keys at the sidecar.
    List {
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[command(flatten)]
        sidecar: SidecarArgs,
    },
    /// Force-release a held key (logged by the sidecar as an audit event).
    Release {
        key: String,
        #[command(flatten)]
        sidecar: SidecarArgs,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("idemgate: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Check { files } => Ok(check(&files)),
        Command::Schema => {
            print!("{CONFIG_SCHEMA}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Key {
            config,
            rule,
            method,
            path,
            scope,
            property,
            key,
        } => {
            let text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            let found = extract::configurations(&text).map_err(anyhow::Error::msg)?;
            let mut configs = Vec::new();
            for f in &found {
                match extract::check(f) {
                    Ok(c) => configs.push(c),
                    Err(errors) => bail!(
                        "{}: {}",
                        config.display(),
                        extract::describe_all(f, &errors)
                    ),
                }
            }
            let Some(parsed) = configs
                .iter()
                .find(|c| c.rules.iter().any(|r| r.name == rule))
                .or(configs.first())
            else {
                bail!("{}: no idemgate configuration found", config.display());
            };
            let call = keys::Call {
                rule,
                method,
                path,
                headers: keys::pairs(&scope, "--scope")?,
                properties: keys::pairs(&property, "--property")?,
                key,
            };
            println!("{}", keys::stored_key(parsed, &call)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Inspect { key, sidecar } => print(admin_of(&sidecar)?.inspect(&key)?),
        Command::List { limit, sidecar } => print(admin_of(&sidecar)?.list(limit)?),
        Command::Release { key, sidecar } => print(admin_of(&sidecar)?.release(&key)?),
    }
}

fn admin_of(args: &SidecarArgs) -> Result<admin::Admin> {
    let token = admin::token(args.token.clone(), args.token_file.as_deref())?;
    admin::Admin::new(&args.sidecar, token)
}

fn print(value: serde_json::Value) -> Result<ExitCode> {
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(ExitCode::SUCCESS)
}

/// Checks every file; prints one line per valid configuration and one per error found.
fn check(files: &[PathBuf]) -> ExitCode {
    let mut failed = false;
    for file in files {
        let name = file.display();
        let found = std::fs::read_to_string(file)
            .map_err(|e| format!("cannot read: {e}"))
            .and_then(|text| extract::configurations(&text));
        let found = match found {
            Ok(found) if found.is_empty() => {
                println!("{name}: no idemgate configuration found");
                failed = true;
                continue;
            }
            Ok(found) => found,
            Err(e) => {
                println!("{name}: {e}");
                failed = true;
                continue;
            }
        };
        for f in &found {
            match extract::check(f) {
                Ok(config) => {
                    let at = [f.document.as_str(), f.path.as_str()]
                        .iter()
                        .filter(|s| !s.is_empty())
                        .copied()
                        .collect::<Vec<_>>()
                        .join(": ");
                    let at = if at.is_empty() {
                        String::new()
                    } else {
                        format!("{at}: ")
                    };
                    println!("{name}: {at}valid ({} rule(s))", config.rules.len());
                }
                Err(errors) => {
                    failed = true;
                    for e in &errors {
                        println!("{name}: {}", extract::describe(f, e));
                    }
                }
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
