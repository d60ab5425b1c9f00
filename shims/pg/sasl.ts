// Stands in for pg/lib/crypto/sasl in the bundle: pg's SCRAM client is loaded on first use (the
// Client waits for load() before pg handles a SASL request). With auth offload edgepg-proxy runs
// SCRAM itself, so most clients never load it. scramMaxIterations left undefined means pg's default.
let real: any
let loading: Promise<unknown> | undefined
export const load = () => (loading ??= import('../../src/scram').then((m) => (real = m.default), (err) => ((loading = undefined), Promise.reject(err))))
export const startSession = (...args: unknown[]) => real.startSession(...args)
export const continueSession = (...args: unknown[]) => real.continueSession(...args)
export const finalizeSession = (...args: unknown[]) => real.finalizeSession(...args)
export default { load, startSession, continueSession, finalizeSession }
