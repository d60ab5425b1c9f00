/**
 * Bundle sizes of the built dist/, measured as an app's bundler sees them: esbuild, minified,
 * gzipped at level 9. Shared by test/size.test.ts (the budgets) and bench/ (the side-by-side).
 */
import * as esbuild from 'esbuild'
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { builtinModules } from 'node:module'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { gzipSync } from 'node:zlib'

const root = fileURLToPath(new URL('../..', import.meta.url))
export const gzip = (code: string | Uint8Array) => gzipSync(code, { level: 9 }).length

/** Node built-ins among a bundle's inputs (shims stand in for all of them). */
const builtinsIn = (inputs: string[]) => inputs.filter((p) => p.startsWith('node:') || builtinModules.includes(p))

/**
 * Bundles a one-file app for the browser; `edgepg` resolves to this package's dist/ (and `pkg`
 * to node_modules), as an installed package would. With `splitting`, measures the entry plus the
 * chunks it imports statically (what loads up front) and, apart, the lazily imported ones.
 */
export async function appBundle(source: string, { format = 'esm', splitting = false, external }: { format?: 'esm' | 'iife'; splitting?: boolean; external?: string[] } = {}) {
  const dir = mkdtempSync(join(tmpdir(), 'edgepg-size-'))
  try {
    writeFileSync(join(dir, 'app.js'), source)
    const result = await esbuild.build({
      entryPoints: [join(dir, 'app.js')],
      bundle: true,
      minify: true,
      format,
      splitting,
      platform: 'browser',
      target: 'es2022',
      outdir: join(dir, 'out'),
      alias: { edgepg: root },
      nodePaths: [join(root, 'node_modules')],
      external,
      metafile: true,
      write: false,
      logLevel: 'silent',
    })
    const files = new Map(result.outputFiles.map((f) => [f.path, f.text]))
    const outputs = result.metafile.outputs
    const entry = Object.keys(outputs).find((p) => outputs[p].entryPoint)!
    const abs = (p: string) => join(process.cwd(), p)
    // the entry and its static imports, transitively
    const upFront = new Set<string>([entry])
    for (const p of upFront) for (const i of outputs[p].imports) if (i.kind === 'import-statement' && outputs[i.path]) upFront.add(i.path)
    const lazy = Object.keys(outputs).filter((p) => !upFront.has(p) && p.endsWith('.js'))
    const code = [...upFront].map((p) => files.get(abs(p))!).join('\n')
    const inputs = Object.keys(result.metafile.inputs)
    return {
      code,
      gzip: gzip(code),
      lazy,
      lazyGzip: lazy.length ? gzip(lazy.map((p) => files.get(abs(p))!).join('\n')) : 0,
      inputs,
      builtins: builtinsIn(inputs),
    }
  } finally {
    rmSync(dir, { recursive: true, force: true })
  }
}

/** The whole driver (everything edgepg exports), ESM as a splitting bundler loads it, and dist/index.cjs. */
export async function driverSizes() {
  const esm = await appBundle(`export * from 'edgepg'`, { splitting: true })
  const cjs = readFileSync(join(root, 'dist/index.cjs'))
  return { esm, cjs: { bytes: cjs.length, gzip: gzip(cjs) } }
}
