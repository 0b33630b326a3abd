//! `helm template` and `helm lint`, run with the real Helm that `cargo xtask
//! setup` links at `.tools/helm` (pinned, checksummed: xtask/src/setup/
//! kube_tools.rs). What the chart renders here is what `helm install`
//! applies: values files read as Helm reads them (YAML 1.1 included), the
//! chart's values.schema.json enforced, Helm's own template functions.

use std::{path::Path, process::Command};

use super::root;

/// One rendered manifest file of the chart (its path under the chart) and
/// its text.
pub struct Rendered {
    pub template: String,
    pub text: String,
}

/// The pinned Helm.
pub fn helm() -> Command {
    Command::new(root().join(".tools/helm"))
}

/// `helm template RELEASE CHART -n NAMESPACE -f FILE... --set A=B...`, split
/// by the `# Source:` line Helm puts before each template's output. An
/// error is Helm's own message (a schema violation, a template error).
pub fn template(
    chart: &Path,
    release: &str,
    namespace: &str,
    value_files: &[&Path],
    sets: &[&str],
) -> Result<Vec<Rendered>, String> {
    let mut cmd = helm();
    cmd.args(["template", release])
        .arg(chart)
        .args(["--namespace", namespace]);
    for file in value_files {
        cmd.arg("--values").arg(file);
    }
    for set in sets {
        cmd.args(["--set", set]);
    }
    let output = cmd.output().map_err(|e| {
        format!(
            "running {}: {e} (run `cargo xtask setup`, which installs it)",
            root().join(".tools/helm").display()
        )
    })?;
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    let text =
        String::from_utf8(output.stdout).map_err(|e| format!("helm printed non-UTF-8: {e}"))?;
    Ok(split_sources(&text))
}

/// Helm's output, one entry per `# Source: CHART/templates/FILE` block.
fn split_sources(text: &str) -> Vec<Rendered> {
    let mut out: Vec<Rendered> = Vec::new();
    for line in text.lines() {
        if let Some(source) = line.strip_prefix("# Source: ") {
            let template = source
                .split_once('/')
                .map_or(source, |(_, path)| path)
                .to_string();
            out.push(Rendered {
                template,
                text: String::new(),
            });
        } else if let Some(current) = out.last_mut() {
            current.text.push_str(line);
            current.text.push('\n');
        }
    }
    out
}

/// `helm lint --strict CHART -f FILE...`: Ok, or Helm's findings.
pub fn lint(chart: &Path, value_files: &[&Path]) -> Result<(), String> {
    let mut cmd = helm();
    cmd.args(["lint", "--strict"]).arg(chart);
    for file in value_files {
        cmd.arg("--values").arg(file);
    }
    let output = cmd
        .output()
        .map_err(|e| format!("running helm lint: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::split_sources;

    #[test]
    fn helm_output_is_split_by_source() {
        let parts = split_sources(
            "---\n# Source: shunt/templates/a.yaml\nkind: A\n---\n# Source: shunt/templates/b.yaml\nkind: B\n",
        );
        let names: Vec<&str> = parts.iter().map(|r| r.template.as_str()).collect();
        assert_eq!(names, ["templates/a.yaml", "templates/b.yaml"]);
        assert_eq!(parts[0].text, "kind: A\n---\n");
        assert_eq!(parts[1].text, "kind: B\n");
    }
}
