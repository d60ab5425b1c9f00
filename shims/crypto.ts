// pg does SCRAM with WebCrypto, which it finds here. For md5 passwords it tries createHash('md5')
// and, when that throws, subtle.digest('MD5'): WebCrypto has no MD5, so that one digest is served
// by @noble/hashes, loaded only when a server asks for md5 (bundlers split it out).
const real = globalThis.crypto
const digest = (algorithm: AlgorithmIdentifier, data: BufferSource): Promise<ArrayBuffer> =>
  algorithm === 'MD5'
    ? import('./md5').then(({ md5 }) => md5(ArrayBuffer.isView(data) ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength) : new Uint8Array(data)).buffer as ArrayBuffer)
    : real.subtle.digest(algorithm, data)

export const webcrypto = {
  getRandomValues: <T extends ArrayBufferView>(array: T): T => real.getRandomValues(array as any) as T,
  subtle: new Proxy(real.subtle, { get: (subtle, key) => (key === 'digest' ? digest : (subtle as any)[key]?.bind?.(subtle)) }),
}
export function createHash(): never {
  throw new Error('edgepg: createHash is not available; md5 goes through webcrypto.subtle.digest')
}
export default { webcrypto, createHash }
