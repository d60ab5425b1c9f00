/**
 * Section "bundle" (`npx tsx bench/run.ts bundle`): what users download and what importing costs.
 *  - Sizes, minified and gzipped (level 9), each bundled by esbuild for the browser as an app's
 *    bundler would (test/support/sizes.ts): everything each driver exports, loaded up front (a splitting
 *    bundler leaves lazy imports out: edgepg's TLS handshake with subtls and its md5; Neon asks the
 *    app for subtls instead) and in one file (no splitting); an app that imports only the HTTP
 *    function; and the files as shipped.
 *  - Cold start: a fresh Node process imports the package's ESM entry; the import alone is timed,
 *    inside the process. The packages alternate, so machine noise hits both alike.
 */
import { execFileSync } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { appBundle, driverSizes, gzip } from '../test/support/sizes'
import { interleave, median, ms, printGrid, type Row, type Section } from './lib'

const COLD_STARTS = 15
const root = fileURLToPath(new URL('..', import.meta.url))
const neonEntry = createRequire(import.meta.url).resolve('@neondatabase/serverless').replace(/index\.js$/, 'index.mjs')
const kb = (bytes: number) => `${(bytes / 1000).toFixed(1)} KB`

/** A shipped ESM file and the files it imports statically (not its lazy `import()`s), joined. */
function shippedClosure(file: string): string {
  const files = [file]
  for (const f of files)
    for (const [, spec] of readFileSync(f, 'utf8').matchAll(/(?:from|import)\s*"(\.[^"]+)"/g)) {
      const path = fileURLToPath(new URL(spec, `file://${f}`))
      if (!files.includes(path)) files.push(path)
    }
  return files.map((f) => readFileSync(f, 'utf8')).join('\n')
}

/** Milliseconds a fresh Node process spends in `await import(file)`. */
function coldImport(file: string): number {
  const out = execFileSync(process.execPath, ['--input-type=module', '-e', `const t = performance.now(); await import(${JSON.stringify(file)}); console.log(performance.now() - t)`], { encoding: 'utf8' })
  return Number(out.trim())
}

export const bundle: Section = {
  name: 'bundle',
  async run() {
    const ours = await driverSizes()
    const neonUpFront = await appBundle(`export * from '@neondatabase/serverless'`, { splitting: true })
    const oursOneFile = await appBundle(`export * from 'edgepg'`)
    const neonOneFile = await appBundle(`export * from '@neondatabase/serverless'`)
    const oursHttp = await appBundle(`import { httpSql } from 'edgepg'; console.log(httpSql)`)
    const neonHttp = await appBundle(`import { neon } from '@neondatabase/serverless'; console.log(neon)`)
    const shipped = (file: string) => gzip(readFileSync(file))
    const neonAndSubtls = await appBundle(`export * from '@neondatabase/serverless'; export * as subtls from 'subtls'`, { external: ['crypto'] }) // (subtls imports Node's crypto only where there is no WebCrypto)

    const rows: Array<[string, number, number, string]> = [
      ['driver, everything exported, loaded up front', ours.esm.gzip, neonUpFront.gzip, 'budget 43 KB'],
      ['  + loaded on use (edgepg: TLS inside the socket with subtls, md5)', ours.esm.lazyGzip, neonUpFront.lazyGzip, 'Neon needs subtls from the app'],
      ['driver in one file (a bundler that does not split)', oursOneFile.gzip, neonOneFile.gzip, 'edgepg: with subtls'],
      ['  the same, with subtls on both sides (TLS inside the socket)', oursOneFile.gzip, neonAndSubtls.gzip, ''],
      ['app importing only the HTTP function (httpSql / neon)', oursHttp.gzip, neonHttp.gzip, 'budget 10 KB'],
      ['CommonJS as shipped (dist/index.cjs / index.js)', ours.cjs.gzip, shipped(neonEntry.replace(/\.mjs$/, '.js')), 'budget 43 KB'],
      ['ESM entry as shipped (edgepg: with its static imports)', gzip(shippedClosure(`${root}dist/index.mjs`)), shipped(neonEntry), ''],
    ]
    const cells = rows.map(([what, a, b, note]) => [what, kb(a), kb(b), b ? (a / b).toFixed(2) + 'x' : '', note])

    const times: Record<'edgepg' | 'neon', number[]> = { edgepg: [], neon: [] }
    const entries = { edgepg: `${root}dist/index.mjs`, neon: neonEntry }
    await interleave(['edgepg', 'neon'] as const, COLD_STARTS, async (key) => void times[key].push(coldImport(entries[key])))
    const cold = { edgepg: median(times.edgepg), neon: median(times.neon) }
    cells.push([`cold start: import in a fresh Node process (median of ${COLD_STARTS})`, ms(cold.edgepg), ms(cold.neon), (cold.edgepg / cold.neon).toFixed(2) + 'x', ''])

    printGrid('Bundle size (minified, gzip -9) and cold start: edgepg vs @neondatabase/serverless', ['what', 'edgepg', 'neon', 'ratio', 'note'], cells, [
      'Sizes bundled by esbuild for the browser from the built packages (test/support/sizes.ts); 1 KB = 1000 bytes.',
      `Up front: what a browser or a splitting bundler loads before the first query; lazy chunks load on first use.`,
    ])
    const row = (metric: string, a: number, b: number, target?: number): Row => ({ metric, edgepg: kb(a), baseline: kb(b), ratio: a / b, target })
    return [
      row('bundle: driver up front (gzip)', ours.esm.gzip, neonUpFront.gzip),
      row('bundle: httpSql-only app (gzip)', oursHttp.gzip, neonHttp.gzip),
      { metric: 'cold import in Node', edgepg: ms(cold.edgepg), baseline: ms(cold.neon), ratio: cold.edgepg / cold.neon },
    ]
  },
}
